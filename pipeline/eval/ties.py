"""Telling a tie of the target from a bug where speculative output departs from greedy.

In exact arithmetic speculative decoding picks greedy's tokens. In bf16 the target's logits for
one position change by a rounding step with the shape of the pass that computes them: a verify
block of 16 tokens or a tree against greedy's one token at a time. Where the target's two best
tokens are that close, the two decodings may part there at a tie of the target itself. Found by
the flagship rehearsal (issue 40): at hidden 5120 and vocabulary 248,320 in bf16, a 1,024-token
prompt's greedy and block outputs parted where the target's logits were 6.03125 and 6.0, one bf16
step apart, and eval called it a bug.

A departure is judged by one plain forward of the target over the common prefix (a third shape,
independent of both decodings): it is a tie when both tokens are within `tie_tolerance` of that
forward's best logit. Anything else (a token far from the best, one output a prefix of the other)
stays a bug, and eval fails on it as before.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from pipeline.eval.speculative_decoding import Decoded
from pipeline.target_model.live import LiveTarget

# Units in the last place of the best logit, in the compute dtype, that two tokens may be apart
# and still tie: rounding in another reduction order moves a logit by a few (one in the case above;
# bf16 at a best logit of 6: 8 x 0.03125 = 0.25, at 30: 1.0; float32 at 6: 4e-6).
TIE_ULPS = 8


def tie_tolerance(best_logit: float, dtype: torch.dtype) -> float:
    """Logits by which two tokens may differ and count as the target's tie, in `dtype`."""
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(best_logit), 1.0)))
    return TIE_ULPS * ulp


@dataclass
class Departure:
    """Where one prompt's speculative output first differs from greedy, and why."""
    prompt: int
    position: int             # index in the generated tokens
    greedy_token: int | None  # None: that output had already ended
    speculative_token: int | None
    gap: float | None         # best logit minus the lower of the two tokens' logits (plain forward)
    tolerance: float | None
    tie: bool

    def record(self) -> dict:
        return asdict(self)


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def judge_departures(live: LiveTarget, prompts: list[list[int]], runs: list[Decoded], reference: list[Decoded],
                     dtype: torch.dtype, *, first: int = 0) -> list[Departure]:
    """A Departure for every prompt whose `runs` output differs from greedy's (`reference`);
    `first`: the number of `prompts[0]` among all of eval's prompts (eval judges a batch at a time)."""
    found = []
    for i, (prompt, run, greedy) in enumerate(zip(prompts, runs, reference), start=first):
        if run.tokens == greedy.tokens:
            continue
        at = first_difference(greedy.tokens, run.tokens)
        if at >= len(greedy.tokens) or at >= len(run.tokens):
            # One output is a prefix of the other: both stop at an end token or at max_new, so a
            # shorter one means a token was lost or made up, never a tie.
            found.append(Departure(i, at, greedy.tokens[at] if at < len(greedy.tokens) else None,
                                   run.tokens[at] if at < len(run.tokens) else None, None, None, False))
            continue
        logits = live.run(prompt + greedy.tokens[:at], None, 0, with_hidden=False, last_only=True).logits[-1]
        a, b = greedy.tokens[at], run.tokens[at]
        best = float(logits.max())
        gap = best - min(float(logits[a]), float(logits[b]))
        tolerance = tie_tolerance(best, dtype)
        found.append(Departure(i, at, a, b, gap, tolerance, gap <= tolerance))
    return found
