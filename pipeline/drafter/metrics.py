"""Training metrics on supervised slots (DESIGN 4), unweighted by decay.

accuracy (top-1 == label), top4_acc / top8_acc (label in the drafter's top-K), avg_streak (per
block, how many leading slots 1, 2, ... are all top-1 correct; tau = avg_streak + 1),
ddtree_streak4 / ddtree_streak8 (leading slots whose label is inside the top-K), pos_acc (per
slot accuracy, slot 1..B-1). A streak stops at the first unsupervised slot.
"""

from __future__ import annotations

import torch


def _streak(ok_AB: torch.Tensor) -> torch.Tensor:
    """Per block, the number of leading True values (slots 1.. only)."""
    return ok_AB[:, 1:].int().cumprod(dim=1).sum(dim=1).float()


@torch.no_grad()
def block_metrics(logits_ABV: torch.Tensor, labels_AB: torch.Tensor, weights_AB: torch.Tensor) -> dict:
    supervised = weights_AB > 0
    ranked = logits_ABV.topk(8, dim=-1).indices                           # [A, B, 8]
    hit = ranked == labels_AB[..., None]
    top1, top4, top8 = hit[..., 0] & supervised, hit[..., :4].any(-1) & supervised, hit.any(-1) & supervised
    count = supervised.sum().clamp_min(1).float()
    per_slot = supervised.sum(0).clamp_min(1).float()
    return {
        "accuracy": float(top1.sum() / count),
        "top4_acc": float(top4.sum() / count),
        "top8_acc": float(top8.sum() / count),
        "avg_streak": float(_streak(top1).mean()) if len(top1) else 0.0,
        "ddtree_streak4": float(_streak(top4).mean()) if len(top4) else 0.0,
        "ddtree_streak8": float(_streak(top8).mean()) if len(top8) else 0.0,
        "pos_acc": [float(x) for x in (top1.sum(0).float() / per_slot)[1:]],
        "supervised_slots": int(supervised.sum()),
    }
