"""The live target during speculative decoding: its cache, its tapped hidden states, and exact rollback.

Gated DeltaNet layers keep a recurrent state that only moves forward: after verifying B draft
tokens, cropping the KV cache of the attention layers does not bring the recurrent state back
to the last accepted token. So the committed state is kept apart: verification runs on a copy,
and when not every draft token was accepted, the accepted tokens are run again on the committed
state (one more, shorter target pass, counted in the report). When all were accepted the
verified state is the committed state and no extra pass runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


@dataclass
class Step:
    logits: torch.Tensor    # [L, V] (or [R, L, V] for batched rows)
    hidden: torch.Tensor | None  # [L, n, H] tapped hidden states (hidden_states[i + 1]); None unless asked for
    state: object           # the cache after these tokens


class LiveTarget:
    def __init__(self, model, taps: list[int]):
        self.model, self.taps = model.eval(), list(taps)
        self.device = next(model.parameters()).device
        self.passes = 0       # target forward passes, all kinds
        self.tokens = 0       # tokens fed through the target

    @torch.no_grad()
    def run(self, tokens: list[int] | torch.Tensor, state, start: int, *, with_hidden: bool = True) -> Step:
        """Feed `tokens` at positions start.. on top of `state` (None: empty). `state` is updated
        in place by transformers; pass a copy to keep the original."""
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(1, -1).to(self.device)
        positions = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        out = self.model(input_ids=ids, position_ids=positions, cache=state, use_cache=True, output_hidden_states=with_hidden)
        self.passes += 1
        self.tokens += ids.shape[1]
        hidden = torch.stack([out.hidden_states[i + 1][0] for i in self.taps], dim=1).float() if with_hidden else None
        return Step(out.logits[0].float(), hidden, out.cache)

    @torch.no_grad()
    def run_rows(self, rows: torch.Tensor, state, start: int) -> torch.Tensor:
        """Logits [R, L, V] for R token rows of equal length, each continuing a copy of `state`
        (tree verification as batched root-to-leaf paths: one target pass)."""
        rows = rows.to(self.device)
        states = _repeat_state(state, rows.shape[0])
        positions = torch.arange(start, start + rows.shape[1], device=self.device)[None].expand(rows.shape[0], -1)
        out = self.model(input_ids=rows, position_ids=positions, cache=states, use_cache=True)
        self.passes += 1
        self.tokens += rows.numel()
        return out.logits.float()

    @staticmethod
    def copy(state):
        return copy.deepcopy(state)


def _repeat_state(state, rows: int):
    """A copy of a batch-1 cache with every state tensor repeated along the batch dimension."""
    def grow(value):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == 1:
            return value.repeat_interleave(rows, dim=0)
        if isinstance(value, dict):
            return {k: grow(v) for k, v in value.items()}
        if isinstance(value, list):
            return [grow(v) for v in value]
        return value

    repeated = copy.deepcopy(state)
    for layer in repeated.layers:
        for name, value in list(vars(layer).items()):
            setattr(layer, name, grow(value))
    return repeated
