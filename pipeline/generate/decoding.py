"""Batched generation with the live target: prompts of any lengths decode together, one target
pass per token for all of them, each exactly as it would alone (no padding inside a pass: every
prompt is prefilled on its own, then the rows share a cache whose key/value slots are marked per
row: pipeline/target_model/plain_rows.py, the loop eval's plain reference shares).

Greedy at temperature 0; otherwise temperature and nucleus (top-p) sampling by the one sampler
(pipeline/sampler.py `Sampler.draw_with`) with one random generator per sequence, seeded by the
caller, so a sequence's tokens do not depend on which other sequences share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.sampler import Sampler
from pipeline.target_model.live import LiveTarget
from pipeline.target_model.plain_rows import decode_plainly


@dataclass
class Generated:
    tokens: list[int]      # the new tokens, the stop token excluded
    finished: bool         # ended with a stop token (False: cut at max_new)


@torch.no_grad()
def generate(target: LiveTarget, prompts: list[list[int]], *, max_new: int, stop: set[int], temperature: float = 0.0,
             top_p: float = 1.0, seeds: list[int] | None = None) -> list[Generated]:
    if temperature > 0 and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError("sampling needs one seed per prompt")
    sampler = Sampler(temperature, top_p=top_p) if temperature > 0 else None
    generators = [torch.Generator().manual_seed(s) for s in seeds] if sampler is not None else None
    out: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)

    def take(i: int, token: int) -> bool:
        if token in stop:
            finished[i] = True
            return False
        out[i].append(token)
        return len(out[i]) < max_new

    def pick(logits: torch.Tensor, active: list[int]) -> list[int]:
        if sampler is None:
            return logits.argmax(-1).tolist()
        return sampler.draw_with(logits, [generators[i] for i in active])

    decode_plainly(target, prompts, pick, take)
    return [Generated(tokens, done) for tokens, done in zip(out, finished)]
