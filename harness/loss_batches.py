"""A small random drafter and random cache samples for the loss tests: a vocabulary of 301 so that
the full logits of a batch stay small, and soft targets whose top-k is a random permutation."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.cache.schema import (HIDDEN, INPUT_IDS, LOSS_MASK, TARGET_ARGMAX, TARGET_LOGSUMEXP, TARGET_TOPK_IDS,
                                   TARGET_TOPK_LOGITS)
from pipeline.drafter.model import DFlashDrafter, DrafterConfig
from pipeline.training.batch import anchor_generator, pack, prepare

H, V, B, TAPS, K = 48, 301, 8, 3, 6


def drafter(seed=0):
    torch.manual_seed(seed)
    config = DrafterConfig(hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=V, target_layer_ids=[1, 3, 5],
                           num_target_layers=8, mask_token_id=V - 1, block_size=B)
    head = torch.nn.Linear(H, V, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5)
    return DFlashDrafter(config, embed=torch.nn.Embedding(V, H), lm_head=head)


def sample(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, K)).astype(np.float32) * 3
    mask = (rng.random(n) < 0.7).astype(np.uint8)
    mask[:2] = 1
    return {INPUT_IDS: rng.integers(0, V - 1, n), LOSS_MASK: mask,
            TARGET_ARGMAX: rng.integers(0, V - 1, n), HIDDEN: rng.normal(size=(n, TAPS, H)).astype(np.float32),
            TARGET_TOPK_IDS: np.stack([rng.permutation(V - 1)[:K] for _ in range(n)]),
            TARGET_TOPK_LOGITS: -np.sort(-logits, axis=1),
            TARGET_LOGSUMEXP: np.log(np.exp(logits).sum(1) + 5.0).astype(np.float32)}


def batch(soft: bool, lengths=(57, 90, 33), vocab=None):
    seqs = [prepare(sample(n, s), block_size=B, num_anchors=9, max_length=4096, mask_token_id=V - 1, gamma=4.0,
                    generator=anchor_generator(0, 0, s), soft=soft, vocab=vocab) for s, n in enumerate(lengths)]
    return pack(seqs, B)
