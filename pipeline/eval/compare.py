"""Every decoding variant on the same prompts, for `pipeline eval`: plain greedy or plain sampling
(the reference and the speed baseline), then each variant of the registry
(pipeline/records/eval_result.py: block speculative decoding, DDTree at each node budget),
timed apart."""

from __future__ import annotations

import time

from pipeline.records.eval_result import Variant
from pipeline.eval.speculative_decoding import Decoded
from pipeline.eval.variants import Settings, decode, reference as plain
from pipeline.target_model.live import LiveTarget

REFERENCE = "greedy"  # the reference's timing key, whether it is greedy or plain sampling


def decode_variants(live: LiveTarget, drafter, prompts: list[list[int]], variants: list[Variant], settings: Settings,
                    progress=None, on_batch=None) -> tuple[list[Decoded], dict[Variant, list[Decoded]], dict[str, float]]:
    """(reference, {variant: results per prompt}, seconds per variant name and REFERENCE); the
    reference is plain greedy decoding, or plain sampling with `settings.sampling` (prompt i's
    random numbers keyed by i, in every variant). With batch_size > 1 the reference and the
    speculative variants decode that many prompts together. After each batch of prompts, once every variant has decoded
    it: `on_batch(first, reference, {variant: results})` with the batch's first prompt number and
    its results (eval judges departures and writes --outputs lines there, outside the timings),
    then `progress(prompts, tokens=, note=)` with the first variant's (block's) tau so far."""
    reference, runs = [], {v: [] for v in variants}
    seconds = {REFERENCE: 0.0, **{v.name: 0.0 for v in variants}}
    for first in range(0, len(prompts), settings.batch_size):
        # Variants alternate per prompt (per batch of prompts), so machine drift hits them all alike.
        chunk = prompts[first:first + settings.batch_size]
        row_ids = list(range(first, first + len(chunk)))
        t0 = time.perf_counter()
        reference += plain(live, chunk, row_ids, settings)
        seconds[REFERENCE] += time.perf_counter() - t0
        for v in variants:
            t0 = time.perf_counter()
            runs[v] += decode(v, live, drafter, chunk, row_ids, settings)
            seconds[v.name] += time.perf_counter() - t0
        if on_batch:
            on_batch(first, reference[first:], {v: results[first:] for v, results in runs.items()})
        if progress and variants:
            lead = runs[variants[0]]
            new_tokens = sum(len(r.tokens) for r in lead[-len(chunk):])
            steps = [a + 1 for r in lead for a in r.accepted]
            progress(len(chunk), tokens=new_tokens, note=f"{variants[0].label} tau {sum(steps) / max(len(steps), 1):.2f}")
    return reference, runs, seconds
