"""Learning-rate schedule shared by the target kit's trainer and the drafter trainer."""

from __future__ import annotations

import math


def warmup_cosine(step: int, *, peak: float, warmup: int, total: int, floor: float = 0.0) -> float:
    """Linear warmup over `warmup` steps, then cosine decay from `peak` to `floor * peak` at `total`.

    `step` counts updates from 0: the first update uses peak / warmup, never 0.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))
