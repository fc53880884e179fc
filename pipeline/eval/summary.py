"""One decoding variant's results over all prompts, summarised against greedy decoding: tau (the
mean of per-response means, as the DFlash paper reports it, and pooled over all verify steps),
the acceptance histogram, target passes and wall time, and whether every output is greedy's (or
departs from it only at a tie of the target: pipeline/eval/ties.py)."""

from __future__ import annotations

import statistics

from pipeline.eval.speculative_decoding import Decoded
from pipeline.eval.ties import Departure, first_difference


def summarise(runs: list[Decoded], reference: list[Decoded], seconds: float, greedy_seconds: float, block: int,
              departures: list[Departure] = (), *, sampled: bool = False) -> dict:
    """`departures`: the judged differences from greedy (ties.judge_departures); a prompt whose
    output differs and is not among them counts as a mismatch. `mismatches` holds the first 20 of
    those prompts, one record each (prompt, position, the two tokens; gap and tolerance where
    judged); the list of their numbers that sat beside it, `mismatched_prompts`, said the same
    and is gone (older files: records/eval_result.py reads them). `sampled`: the reference is plain
    sampling, whose outputs a sampled speculative run shares only in distribution (tested, not
    compared per prompt), so the speed-up is against it and there is no identity to count."""
    steps = [a + 1 for r in runs for a in r.accepted]
    tokens = sum(len(r.tokens) for r in runs)
    histogram = {str(k): 0 for k in range(1, block + 1)}
    for s in steps:
        histogram[str(s)] = histogram.get(str(s), 0) + 1
    ties = [d for d in departures if d.tie]
    tied = {d.prompt for d in ties}
    judged = {d.prompt: d for d in departures if not d.tie}
    # One record per prompt that departs from greedy other than at a tie: its judged departure, or
    # (not judged) where the two outputs part, so the list says which prompts and where.
    mismatches = [judged.get(i) or _unjudged(i, g.tokens, r.tokens)
                  for i, (r, g) in enumerate(zip(runs, reference)) if r.tokens != g.tokens and i not in tied]
    figures = {
        **tau_figures(runs),
        "accept_histogram": histogram,
        "verify_passes_per_token": sum(r.verify_passes for r in runs) / max(tokens, 1),
        "target_tokens_per_verify": sum(r.verify_tokens for r in runs) / max(sum(r.verify_passes for r in runs), 1),
        "target_passes_per_token": sum(r.target_passes for r in runs) / max(tokens, 1),
        "tokens": tokens, "wall_s": seconds, "tokens_per_s": tokens / max(seconds, 1e-9),
    }
    if sampled:
        return {**figures, "speedup_vs_plain_sampling": greedy_seconds / max(seconds, 1e-9)}
    return {
        **figures,
        "speedup_vs_greedy": greedy_seconds / max(seconds, 1e-9),
        "identical_to_greedy": len(runs) - len(mismatches) - len(tied),
        "departed_at_ties": len(tied), "ties": [d.record() for d in ties[:20]],
        "mismatches": [d.record() for d in mismatches[:20]],
    }


def _unjudged(prompt: int, greedy: list[int], speculative: list[int]) -> Departure:
    """Where two outputs part, with no forward to judge the gap: a mismatch."""
    at = first_difference(greedy, speculative)
    return Departure(prompt, at, greedy[at] if at < len(greedy) else None,
                     speculative[at] if at < len(speculative) else None, None, None, False)


def tau_figures(runs: list[Decoded]) -> dict:
    """tau as the mean of per-response means and pooled over verify steps, and the steps: the
    figures a group of prompts is compared by (a group's pooled tau times its steps sums to the
    whole's)."""
    per_response = [statistics.mean(a + 1 for a in r.accepted) for r in runs if r.accepted]
    steps = [a + 1 for r in runs for a in r.accepted]
    return {"tau_mean_of_means": statistics.mean(per_response) if per_response else 0.0,
            "tau_pooled": statistics.mean(steps) if steps else 0.0, "verify_steps": len(steps)}
