"""Batched generation with the live target: prompts of any lengths decode together, one target
pass per token for all of them, each exactly as it would alone (no padding inside a pass: every
prompt is prefilled on its own, then the rows share a cache whose key/value slots are marked per
row: pipeline/target_model/plain_rows.py, the loop eval's plain reference shares).

Greedy at temperature 0; otherwise temperature and nucleus (top-p) sampling with one random
generator per sequence, seeded by the caller, so a sequence's tokens do not depend on which other
sequences share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.target_model.live import LiveTarget
from pipeline.target_model.plain_rows import decode_plainly


@dataclass
class Generated:
    tokens: list[int]      # the new tokens, the stop token excluded
    finished: bool         # ended with a stop token (False: cut at max_new)


def choose(logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator] | None) -> list[int]:
    """The next token of each row of logits [B, V]."""
    if temperature <= 0:
        return logits.argmax(-1).tolist()
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p    # tokens after the nucleus is full
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return [int(torch.multinomial(p, 1, generator=g)) for p, g in zip(probs, generators)]


@torch.no_grad()
def generate(target: LiveTarget, prompts: list[list[int]], *, max_new: int, stop: set[int], temperature: float = 0.0,
             top_p: float = 1.0, seeds: list[int] | None = None) -> list[Generated]:
    if temperature > 0 and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError("sampling needs one seed per prompt")
    generators = [torch.Generator().manual_seed(s) for s in seeds] if temperature > 0 else None
    out: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)

    def take(i: int, token: int) -> bool:
        if token in stop:
            finished[i] = True
            return False
        out[i].append(token)
        return len(out[i]) < max_new

    decode_plainly(target, prompts, lambda logits, active: choose(logits, temperature, top_p,
                                                                  [generators[i] for i in active] if generators else None), take)
    return [Generated(tokens, done) for tokens, done in zip(out, finished)]
