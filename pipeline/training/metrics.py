"""Training metrics on supervised slots (DESIGN 4), unweighted by decay.

accuracy (top-1 == label), top4_acc / top8_acc (label in the drafter's top-K), avg_streak (per
block, how many leading slots 1, 2, ... are all top-1 correct; tau = avg_streak + 1),
ddtree_streak4 / ddtree_streak8 (leading slots whose label is inside the top-K), pos_acc (per
slot accuracy, slot 1..B-1). A streak stops at the first unsupervised slot. With a draft
vocabulary a slot whose label is outside it (`outside_AB`) counts as supervised and missed at
every K (the drafter cannot propose it, so it cannot be accepted), and `outside_vocab` is the
share of such slots.

Metrics are kept as sums (`metric_sums`) so micro-batches and data-parallel ranks add up exactly
before `finish_metrics` divides once; averaging per-rank means would weight ranks wrongly.
"""

from __future__ import annotations

import torch


def _streak(ok_AB: torch.Tensor) -> torch.Tensor:
    """Per block, the number of leading True values (slots 1.. only)."""
    return ok_AB[:, 1:].int().cumprod(dim=1).sum(dim=1).float()


@torch.no_grad()
def metric_sums(logits_ABV: torch.Tensor, labels_AB: torch.Tensor, weights_AB: torch.Tensor,
                blocks_A: torch.Tensor | None = None, outside_AB: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Sums behind every metric, from full logits. `blocks_A` marks real blocks (False for padding rows)."""
    ranked = logits_ABV.topk(min(8, logits_ABV.shape[-1]), dim=-1).indices
    hit = ranked == labels_AB[..., None]
    return hit_sums(torch.stack([hit[..., 0], hit[..., :4].any(-1), hit.any(-1)], dim=-1), weights_AB, blocks_A,
                    outside_AB)


@torch.no_grad()
def hit_sums(hits_AB3: torch.Tensor, weights_AB: torch.Tensor, blocks_A: torch.Tensor | None = None,
             outside_AB: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Sums behind every metric, from each slot's (top-1, top-4, top-8) hits (only supervised
    slots count; pipeline/training/loss.py computes hits for those alone; a slot `outside_AB`
    marks is supervised and never hit)."""
    if outside_AB is not None:
        hits_AB3 = hits_AB3 & ~outside_AB[..., None]
    supervised = weights_AB > 0 if outside_AB is None else (weights_AB > 0) | outside_AB
    real = torch.ones(len(weights_AB), dtype=torch.bool, device=weights_AB.device) if blocks_A is None else blocks_A
    top1, top4, top8 = (hits_AB3[..., i] & supervised for i in range(3))
    f = torch.float64
    return {
        "supervised": supervised.sum().to(f),
        "top1": top1.sum().to(f), "top4": top4.sum().to(f), "top8": top8.sum().to(f),
        "blocks": real.sum().to(f),
        "streak1": (_streak(top1) * real).sum().to(f),
        "streak4": (_streak(top4) * real).sum().to(f),
        "streak8": (_streak(top8) * real).sum().to(f),
        "slot_hits": top1.sum(0).to(f), "slot_count": supervised.sum(0).to(f),
        **({} if outside_AB is None else {"outside": outside_AB.sum().to(f)}),
    }


def add_sums(total: dict | None, more: dict) -> dict:
    return dict(more) if total is None else {k: total[k] + more[k] for k in total}


def finish_metrics(sums: dict[str, torch.Tensor]) -> dict:
    count = float(sums["supervised"].clamp_min(1))
    blocks = float(sums["blocks"].clamp_min(1))
    per_slot = sums["slot_hits"] / sums["slot_count"].clamp_min(1)
    return {
        "accuracy": float(sums["top1"]) / count,
        "top4_acc": float(sums["top4"]) / count,
        "top8_acc": float(sums["top8"]) / count,
        "avg_streak": float(sums["streak1"]) / blocks,
        "ddtree_streak4": float(sums["streak4"]) / blocks,
        "ddtree_streak8": float(sums["streak8"]) / blocks,
        "pos_acc": [float(x) for x in per_slot[1:]],
        "supervised_slots": int(sums["supervised"]),
        **({"outside_vocab": float(sums["outside"]) / count} if "outside" in sums else {}),
    }


def block_metrics(logits_ABV: torch.Tensor, labels_AB: torch.Tensor, weights_AB: torch.Tensor) -> dict:
    return finish_metrics(metric_sums(logits_ABV, labels_AB, weights_AB))
