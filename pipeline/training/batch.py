"""From decoded cache samples to one padded drafter forward, and its loss.

`prepare` turns one sample into blocks (anchors resampled from (seed, epoch, sample id), so the
choice is the same whatever the world size or resume point); `pack` lays several sequences side
by side, padded, so a micro-batch is one forward; the block-sparse mask is built from the
anchors on the compute device (`block_mask`), never shipped. Padding carries weight 0.

With a draft vocabulary (pipeline/drafter/vocab.py) labels and soft-target ids are the head's draft
ids; a slot whose label is outside the vocabulary gets weight 0 and is marked `outside` (the
metrics count it as a miss: pipeline/training/draft_vocab.py says why), and a soft target keeps
its top-k entries inside the vocabulary, renormalised over them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.cache.schema import (HIDDEN, INPUT_IDS, LOSS_MASK, TARGET_ARGMAX, TARGET_LOGSUMEXP, TARGET_TOPK_IDS,
                                   TARGET_TOPK_LOGITS)
from pipeline.drafter.attention_rule import block_mask
from pipeline.drafter.vocab import DraftVocab
from pipeline.training.blocks import block_soft_targets, block_targets, block_tokens, sample_anchors
from pipeline.training.objectives import weighted_ce, weighted_soft_kl


@dataclass
class SequenceBlocks:
    hidden: torch.Tensor        # [T, n, H] float32: the tapped hidden states
    block_ids: torch.Tensor     # [A*B]
    block_pos: torch.Tensor     # [A*B]
    anchors: torch.Tensor       # [A]
    labels: torch.Tensor        # [A, B]
    weights: torch.Tensor       # [A, B]
    soft_ids: torch.Tensor | None = None    # [A, B, K]
    soft_probs: torch.Tensor | None = None  # [A, B, K]
    outside: torch.Tensor | None = None     # [A, B] bool: supervised, but the label is outside the draft vocabulary
    real: bool = True           # False: placeholder's block, which no metric counts

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[0]


@dataclass
class PackedBatch:
    hidden: torch.Tensor        # [S, T, n, H]
    block_ids: torch.Tensor     # [S, Q]
    block_pos: torch.Tensor     # [S, Q]
    anchors: torch.Tensor       # [S, A], 0 for padding blocks
    labels: torch.Tensor        # [S*A, B]
    weights: torch.Tensor       # [S*A, B]
    real_blocks: torch.Tensor   # [S*A] bool
    soft_ids: torch.Tensor | None = None
    soft_probs: torch.Tensor | None = None
    outside: torch.Tensor | None = None     # [S*A, B] bool, with a draft vocabulary

    def to(self, device) -> PackedBatch:
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return PackedBatch(**moved)


def anchor_generator(seed: int, epoch: int, sample_id: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003 + epoch) * 2_147_483_647 + sample_id) % 2**63)


def noise_generator(seed: int, step: int, sample_id: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 999_983 + step) * 2_147_483_629 + sample_id + 0x5EED) % 2**63)


def context_noise(shape, std: float, generator: torch.Generator, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Gaussian noise of `std` for context features of `shape` (DESIGN 3.6). `scale`: on a
    projected cache, 1 / each component's scale (pipeline/projection): noise of std s on every
    full tap value, projected onto the orthonormal basis, is noise of std s on each component,
    divided by the component's scale as the stored values are, so --noise-std means the same on
    either cache."""
    noise = std * torch.randn(shape, generator=generator)
    return noise if scale is None else noise * scale


def prepare(sample: dict, *, block_size: int, num_anchors: int, max_length: int, mask_token_id: int, gamma: float,
            generator: torch.Generator, soft: bool = False,
            vocab: DraftVocab | None = None) -> SequenceBlocks | None:
    """Blocks for one sample (None if it has no valid anchor). Labels come from the stored target
    outputs, never from `hidden`: the training step adds its noise (context_noise) to the context
    features after this (DESIGN 3.6). `vocab`: labels (and soft-target ids) as its draft ids
    (module docstring)."""
    n = min(len(sample[INPUT_IDS]), max_length)
    ids = torch.from_numpy(np.asarray(sample[INPUT_IDS][:n], dtype=np.int64))
    mask = torch.from_numpy(np.asarray(sample[LOSS_MASK][:n], dtype=np.int64))
    anchors = sample_anchors(mask, num_anchors, generator)
    if len(anchors) == 0:
        return None
    hidden = sample[HIDDEN][:n]
    hidden = (hidden if isinstance(hidden, torch.Tensor) else torch.from_numpy(np.asarray(hidden))).float()
    argmax = torch.from_numpy(np.asarray(sample[TARGET_ARGMAX][:n], dtype=np.int64))
    block_ids, pos = block_tokens(ids, anchors, block_size, mask_token_id)
    labels, weights = block_targets(argmax, mask, anchors, block_size, gamma)
    out = SequenceBlocks(hidden, block_ids, pos, anchors, labels, weights)
    if soft:
        out.soft_ids, out.soft_probs = block_soft_targets(
            torch.from_numpy(np.asarray(sample[TARGET_TOPK_IDS][:n], dtype=np.int64)),
            torch.from_numpy(np.asarray(sample[TARGET_TOPK_LOGITS][:n], dtype=np.float32)),
            torch.from_numpy(np.asarray(sample[TARGET_LOGSUMEXP][:n], dtype=np.float32)), anchors, block_size)
    if vocab is not None:
        _to_draft_vocab(out, vocab)
    return out


def _to_draft_vocab(blocks: SequenceBlocks, vocab: DraftVocab) -> None:
    labels, inside = vocab.to_draft(blocks.labels)
    supervised = blocks.weights > 0
    blocks.outside = supervised & ~inside
    blocks.weights = torch.where(inside, blocks.weights, torch.zeros_like(blocks.weights))
    blocks.labels = torch.where(blocks.weights > 0, labels, torch.zeros_like(labels))
    if blocks.soft_ids is not None:
        ids, kept = vocab.to_draft(blocks.soft_ids)
        probs = blocks.soft_probs * kept
        renormalised = probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)
        blocks.soft_ids = ids
        # A row with nothing dropped keeps its probabilities as they were (bit for bit).
        blocks.soft_probs = torch.where(kept.all(-1, keepdim=True), blocks.soft_probs, renormalised)


def pack(items: list[SequenceBlocks], block_size: int) -> PackedBatch:
    s = len(items)
    t = max(x.num_tokens for x in items)
    a = max(x.labels.shape[0] for x in items)
    q = a * block_size
    n_taps, hidden_size = items[0].hidden.shape[1:]
    hidden = torch.zeros(s, t, n_taps, hidden_size)
    block_ids = torch.zeros(s, q, dtype=torch.long)
    block_pos = torch.zeros(s, q, dtype=torch.long)
    anchors = torch.zeros(s, a, dtype=torch.long)
    labels = torch.zeros(s, a, block_size, dtype=torch.long)
    weights = torch.zeros(s, a, block_size)
    real = torch.zeros(s, a, dtype=torch.bool)
    soft = items[0].soft_ids is not None
    outside = torch.zeros(s, a, block_size, dtype=torch.bool) if items[0].outside is not None else None
    if soft:
        k = items[0].soft_ids.shape[-1]
        soft_ids = torch.zeros(s, a, block_size, k, dtype=torch.long)
        soft_probs = torch.zeros(s, a, block_size, k)
    for i, x in enumerate(items):
        ti, ai = x.num_tokens, x.labels.shape[0]
        qi = ai * block_size
        hidden[i, :ti] = x.hidden
        block_ids[i, :qi], block_pos[i, :qi] = x.block_ids, x.block_pos
        anchors[i, :ai] = x.anchors
        labels[i, :ai], weights[i, :ai], real[i, :ai] = x.labels, x.weights, x.real
        if soft:
            soft_ids[i, :ai], soft_probs[i, :ai] = x.soft_ids, x.soft_probs
        if outside is not None:
            outside[i, :ai] = x.outside
    return PackedBatch(hidden, block_ids, block_pos, anchors, labels.view(s * a, block_size),
                       weights.view(s * a, block_size), real.view(-1),
                       soft_ids.view(s * a, block_size, -1) if soft else None,
                       soft_probs.view(s * a, block_size, -1) if soft else None,
                       outside.view(s * a, block_size) if outside is not None else None)


def forward_logits(drafter, batch: PackedBatch) -> torch.Tensor:
    """Logits [S*A, B, V] for a packed batch (one forward for all its sequences and anchors);
    for evaluation and as the reference: training never materialises them (final_hidden)."""
    allowed = block_mask(batch.anchors, batch.hidden.shape[1], batch.labels.shape[1])
    logits = drafter(batch.hidden, batch.block_ids, batch.block_pos, allowed)
    return logits.view(batch.labels.shape[0], batch.labels.shape[1], -1)


def final_hidden(drafter, batch: PackedBatch) -> torch.Tensor:
    """The drafter's final normed states [S*A, B, H], what the lm_head takes (training's loss
    input); attention from the anchors, without the dense mask (split_block_attention)."""
    out = drafter(batch.hidden, batch.block_ids, batch.block_pos, anchors_BA=batch.anchors, logits=False)
    return out.view(batch.labels.shape[0], batch.labels.shape[1], -1)


def loss_sum(logits, batch: PackedBatch, kind: str) -> torch.Tensor:
    """sum over slots of loss * w (divide by the global sum of w to get DESIGN 3.4's loss)."""
    total = batch.weights.sum()
    if kind == "kl":
        return weighted_soft_kl(logits, batch.soft_ids, batch.soft_probs, batch.weights) * total
    return weighted_ce(logits, batch.labels, batch.weights) * total


def placeholder(config, soft_k: int | None = None, vocab: bool = False) -> SequenceBlocks:
    """One all-zero-weight block: a rank whose share of a step has no anchor still runs a forward
    and backward, so data-parallel gradient reduction stays in lockstep. It adds nothing to the
    loss or to any metric (not even the block count the streaks are averaged over). Its context
    has the cache's shape: n_taps taps of hidden_size, or one row of R projected values."""
    b = config.block_size
    ids = torch.full((b,), config.mask_token_id, dtype=torch.long)
    taps = (1, config.projected_rank) if config.projected_rank else (len(config.target_layer_ids), config.hidden_size)
    out = SequenceBlocks(torch.zeros(1, *taps), ids, torch.arange(b), torch.zeros(1, dtype=torch.long),
                         torch.zeros(1, b, dtype=torch.long), torch.zeros(1, b), real=False)
    if soft_k:
        out.soft_ids = torch.zeros(1, b, soft_k, dtype=torch.long)
        out.soft_probs = torch.full((1, b, soft_k), 1.0 / soft_k)
    if vocab:
        out.outside = torch.zeros(1, b, dtype=torch.bool)
    return out
