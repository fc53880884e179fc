"""Plain decoding of several prompts at once, one target pass per token for all of them: the loop
that `pipeline generate` (pipeline/generate/decoding.py) and eval's plain reference
(pipeline/eval/speculative_decoding.py `greedy_rows`) share. Each prompt is prefilled on its own, then the
rows share a cache whose key/value slots are marked per row (`LiveTarget.prefill_rows` /
`step_rows`), so a prompt decodes as it would alone; a prompt that is done leaves the batch. The
callers say how a token is picked and when a prompt is done."""

from __future__ import annotations

from typing import Callable

import torch

from pipeline.target_model.live import LiveTarget


@torch.no_grad()
def decode_plainly(target: LiveTarget, prompts: list[list[int]], pick: Callable[[torch.Tensor, list[int]], list[int]],
                   take: Callable[[int, int], bool]) -> list[int]:
    """`pick(logits, active)`: a token for each active prompt from its next-token logits (a row of
    [R, V]; `active` lists the prompts' indices). `take(i, token)`: prompt i takes the token;
    False when it is then done. Returns each prompt's target passes (its prefill, then the steps
    it took part in)."""
    rows, steps = target.prefill_rows(prompts, with_hidden=False)
    logits = torch.cat([s.logits[-1:] for s in steps])
    passes = [1] * len(prompts)
    active = list(range(len(prompts)))
    while active:
        tokens = pick(logits, active)
        keep = [r for r, (i, token) in enumerate(zip(active, tokens)) if take(i, token)]
        if not keep:
            break
        if len(keep) < len(active):
            rows = target.keep_rows(rows, keep)
            active = [active[r] for r in keep]
        logits, rows = target.step_rows([tokens[r] for r in keep], rows)
        for i in active:
            passes[i] += 1
    return passes
