"""Anchors, block inputs and the loss targets (DESIGN 3.3, 3.4); the attention mask the blocks
get is the drafter's own rule (pipeline/drafter/attention_rule.py: `block_mask`).

For a sequence of length T and sorted anchors a_1..a_A, the drafter sees A blocks of B slots:
slot 0 holds the anchor token input_ids[a], slots 1..B-1 the mask token, at positions a..a+B-1.
Slot k (k >= 1) predicts position a+k; its label is target_argmax[a+k-1] (the target's own
prediction), with weight exp(-(k-1)/gamma) * loss_mask[a+k] * [a+k < T]. Slot 0 is never in
the loss.
"""

from __future__ import annotations

import torch

from pipeline.drafter.attention_rule import block_mask


def valid_anchors(loss_mask_T: torch.Tensor) -> torch.Tensor:
    """Positions a with loss_mask[a] == 1 and loss_mask[a+1] == 1."""
    m = loss_mask_T.bool()
    return torch.nonzero(m[:-1] & m[1:]).flatten()


def sample_anchors(loss_mask_T: torch.Tensor, num: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `num` valid anchors, without replacement, sorted (resample each epoch with a new generator state)."""
    valid = valid_anchors(loss_mask_T)
    if len(valid) <= num:
        return valid
    pick = torch.randperm(len(valid), generator=generator)[:num]
    return valid[pick].sort().values


def block_tokens(input_ids_T: torch.Tensor, anchors_A: torch.Tensor, block_size: int, mask_token_id: int):
    """(block_ids [A*B], block_pos [A*B]): the anchor token then mask tokens, at positions a..a+B-1."""
    slots = torch.arange(block_size)
    block_pos = (anchors_A[:, None] + slots[None]).reshape(-1)
    block_ids = torch.full((anchors_A.shape[0], block_size), mask_token_id, dtype=input_ids_T.dtype)
    block_ids[:, 0] = input_ids_T[anchors_A]
    return block_ids.reshape(-1), block_pos


def block_inputs(input_ids_T: torch.Tensor, anchors_A: torch.Tensor, block_size: int, mask_token_id: int):
    """(block_ids [A*B], block_pos [A*B], allowed [A*B, T + A*B]) for one sequence."""
    block_ids, block_pos = block_tokens(input_ids_T, anchors_A, block_size, mask_token_id)
    return block_ids, block_pos, block_mask(anchors_A[None], input_ids_T.shape[0], block_size)[0]


def decay_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k for slots 0..B-1: 0 for slot 0, exp(-(k-1)/gamma) after."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def block_targets(target_argmax_T, loss_mask_T, anchors_A, block_size: int, gamma: float):
    """(labels [A, B], weights [A, B]); unsupervised slots have weight 0 and label 0."""
    t = target_argmax_T.shape[0]
    pos = anchors_A[:, None] + torch.arange(block_size)[None]            # position each slot predicts
    inside = pos < t
    safe = pos.clamp(max=t - 1)
    labels = target_argmax_T[(safe - 1).clamp(min=0)].long()
    weights = decay_weights(block_size, gamma)[None] * loss_mask_T[safe].float() * inside.float()
    weights[:, 0] = 0.0
    labels = torch.where(weights > 0, labels, torch.zeros_like(labels))
    return labels, weights


def default_gamma(block_size: int) -> float:
    """DESIGN 3.4: 7 for B=16, 5 for B=10, 4 for B=8 (and the nearest of those otherwise; halfway
    between two, the larger block size's: `min` takes the first of equals, in the table's order)."""
    table = {16: 7.0, 10: 5.0, 8: 4.0}
    return table.get(block_size, table[min(table, key=lambda b: abs(b - block_size))])


def block_soft_targets(topk_ids_TK, topk_logits_TK, logsumexp_T, anchors_A, block_size: int):
    """(ids [A, B, K], probs [A, B, K]): the target's top-k distribution for each slot's position.

    Slot k takes the top-k stored at position a+k-1 (the same alignment as the hard label).
    Stored logits minus the stored full-vocab logsumexp give exact probabilities; they are
    renormalised over the top-k, so the soft target is a distribution.
    """
    t = topk_ids_TK.shape[0]
    source = (anchors_A[:, None] + torch.arange(block_size)[None] - 1).clamp(0, t - 1)
    logp = topk_logits_TK[source].float() - logsumexp_T[source].float()[..., None]
    return topk_ids_TK[source].long(), torch.softmax(logp, dim=-1)
