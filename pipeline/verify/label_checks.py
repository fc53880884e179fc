"""Model-free checks of the stored labels (DESIGN 10): label alignment (the target's argmax at
t-1 is the token at t on supervised positions, and not better at a shift of one) and top-k
consistency (argmax is the top-1, logits sorted, logsumexp above the top logit), over every
sample, one window of whole samples at a time.
"""

from __future__ import annotations

import numpy as np

from pipeline.verify.bounded_reads import sample_windows, sound_shards
from pipeline.verify.check_report import Check, SampleList
from pipeline.cache.reader import CacheReader
from pipeline.cache.schema import (HARD_LABEL, INPUT_IDS, LOSS_MASK, SAMPLE_TOKENS, SOFT_LABEL, TARGET_ARGMAX,
                                   TARGET_LOGSUMEXP, TARGET_TOPK_IDS, TARGET_TOPK_LOGITS, role_names)
from pipeline.errors import PipelineError


def check_alignment(reader: CacheReader, shards: list[str]) -> tuple[Check, Check]:
    """Label alignment (target_argmax[t-1] == input_ids[t] on supervised t, at shifts -1/0/+1)
    and top-k consistency over every sample, one window of whole samples at a time. A sample
    whose labels agree better at a shift than in place, or far below the cache's own agreement,
    is named: extractor bugs are often confined to some samples (DESIGN 10)."""
    hits = {-1: 0, 0: 0, 1: 0}
    counts = {-1: 0, 0: 0, 1: 0}
    topk_problems = {"argmax_not_top1": 0, "logits_not_sorted": 0, "logsumexp_below_max": 0}
    topk_samples = SampleList()
    per_sample = []  # (shard, sample id, supervised, hits at -1, 0, +1)
    tokens = 0
    for name, shard in sound_shards(reader, shards):
        for lo, hi in sample_windows(shard.offsets):
            a, b = int(shard.offsets[lo]), int(shard.offsets[hi])
            try:
                stored = {k: shard.read_range(k, a, b) for k in role_names(SAMPLE_TOKENS, HARD_LABEL, SOFT_LABEL)}
            except PipelineError:
                continue  # reported by the checksum check
            ids, mask, arg = stored[INPUT_IDS], stored[LOSS_MASK], stored[TARGET_ARGMAX]
            top_ids, top_logits, lse = stored[TARGET_TOPK_IDS], stored[TARGET_TOPK_LOGITS], stored[TARGET_LOGSUMEXP]
            starts = (shard.offsets[lo:hi] - a).astype(np.int64)
            ends = (shard.offsets[lo + 1:hi + 1] - a).astype(np.int64)
            sample_of = np.repeat(np.arange(hi - lo), ends - starts)
            pos = np.arange(b - a) - starts[sample_of]
            length = (ends - starts)[sample_of]
            sample_hits = {}
            for shift in (-1, 0, 1):
                src = np.arange(b - a) - 1 + shift
                ok = (mask == 1) & (pos - 1 + shift >= 0) & (pos - 1 + shift < length) & (pos >= 1)
                idx = np.nonzero(ok)[0]
                same = arg[src[idx]] == ids[idx]
                hits[shift] += int(same.sum())
                counts[shift] += len(idx)
                sample_hits[shift] = np.bincount(sample_of[idx], weights=same, minlength=hi - lo)
                if shift == 0:
                    supervised = np.bincount(sample_of[idx], minlength=hi - lo)
            for k in range(hi - lo):
                per_sample.append((name, int(shard.sample_ids[lo + k]), int(supervised[k]),
                                   *(int(sample_hits[s][k]) for s in (-1, 0, 1))))
            bad = {"argmax_not_top1": arg != top_ids[:, 0],
                   "logits_not_sorted": (np.diff(top_logits, axis=1) > 0).any(axis=1),
                   "logsumexp_below_max": lse < top_logits[:, 0] - 1e-3}
            for key, flags in bad.items():
                topk_problems[key] += int(flags.sum())
            topk_samples.add_tokens(shard, a + np.flatnonzero(np.any(list(bad.values()), axis=0)))
            tokens += b - a
    rates = {s: hits[s] / counts[s] if counts[s] else None for s in hits}
    best = max((s for s in rates if rates[s] is not None), key=lambda s: rates[s], default=None)
    names = {-1: "t-2", 0: "t-1", 1: "t"}
    misaligned = misaligned_samples(per_sample, rates[0] or 0.0)
    summary = ", ".join(f"argmax[{names[s]}]==ids[t]: {rates[s]:.3f}" for s in (-1, 0, 1) if rates[s] is not None)
    # A target that predicts none of the data at any shift (random weights, or another model wrote
    # the data) says nothing about alignment: inconclusive, not a shift picked from noise.
    inconclusive = best is not None and rates[best] < INCONCLUSIVE_RATE and not misaligned
    aggregate_ok = best == 0 and rates[0] is not None and rates[0] > max(rates[-1] or 0, rates[1] or 0) + 0.05
    if inconclusive:
        summary = (f"the target's argmax agrees with the data at no shift ({summary}; all under "
                   f"{INCONCLUSIVE_RATE}), so alignment cannot be told (random weights, or the data was not written by this target)")
    elif not aggregate_ok and best is not None:
        summary += f" (best is argmax[{names[best]}]: labels look shifted by {best:+d})" if best else " (no clear winner)"
    summary = (summary or "no supervised positions") + f"; {len(per_sample)} samples checked"
    if misaligned:
        summary += f"; {misaligned.describe()}"
    alignment = Check("label_alignment", inconclusive or (aggregate_ok and not misaligned), summary,
                      {"rates_by_shift": {str(s): r for s, r in rates.items()}, "supervised_positions": counts[0],
                       "samples": len(per_sample), **misaligned.evidence()}, inconclusive=inconclusive)
    topk = Check("topk_consistency", not any(topk_problems.values()),
                 f"{tokens} tokens: " + ", ".join(f"{k} {v}" for k, v in topk_problems.items())
                 + (f"; {topk_samples.describe()}" if topk_samples else ""), {**topk_problems, **topk_samples.evidence()})
    return alignment, topk


# Below this agreement at every shift, label alignment cannot be told from agreement. A target that
# wrote its data agrees with it far above (the embedded target: about 0.97 in place).
INCONCLUSIVE_RATE = 0.02


def misaligned_samples(per_sample: list[tuple], cache_rate: float) -> "SampleList":
    """Samples whose labels agree better at a shift of one than in place (by at least 2 positions
    and 10% of their supervised positions), or, with 16+ supervised positions, at under half the
    cache's own agreement (the rate depends on whether the target wrote the data)."""
    out = SampleList()
    for name, sid, n, before, here, after in per_sample:
        shift, best = max(((-1, before), (1, after)), key=lambda x: x[1])
        if best - here >= max(2, 0.1 * n):
            out.add(name, sid, f"labels agree best at shift {shift:+d} ({best}/{n} vs {here}/{n} in place)")
        elif n >= 16 and here / n < 0.5 * cache_rate:
            out.add(name, sid, f"label agreement {here}/{n}, under half the cache's {cache_rate:.3f}")
    return out
