"""The live target during speculative decoding: its cache, its tapped hidden states, and exact rollback.

Gated DeltaNet layers keep a recurrent state that only moves forward: after verifying B draft
tokens, cropping the KV cache of the attention layers does not bring the recurrent state back
to the last accepted token. So verification (`verify`, `verify_rows`) runs on a copy of the
committed state that records what a rollback needs: transformers' cache keeps the conv inputs of
every verified position (`activate_past_recording`), and the gated delta rule's state after each
verified position is computed alongside the verify pass (the chunked rule gives only the last;
`_recording_states` steps the recurrent rule over the few verified tokens from the same initial
state). `commit` then crops the cache to the accepted tokens and sets each recurrent state to
the one after the last accepted token: no second target pass (tested against re-running the
accepted tokens on the committed state, which is what decoding did before).

This module is where the speculative decoder touches transformers' internals (the cache's layers
and their states, the qwen3_5 modeling module's gated delta rule functions);
tests/test_transformers_internals.py names each one.
"""

from __future__ import annotations

import contextlib
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
    def verify(self, tokens: list[int], state, start: int, *, with_hidden: bool = True) -> Verified:
        """`run` on a recording copy of `state`: `commit` can then keep any prefix of `tokens`."""
        recording = _recording_copy(state)
        with _recording_states() as states:
            step = self.run(tokens, recording, start, with_hidden=with_hidden)
        return Verified(step, len(tokens), states)

    @torch.no_grad()
    def verify_rows(self, rows: torch.Tensor, state, start: int) -> Verified:
        """Logits [R, L, V] and tapped hidden states [R, L, n, H] for R token rows of equal length,
        each continuing `state` (tree verification as batched root-to-leaf paths: one target
        pass), on a recording copy; `commit` keeps a prefix of one row."""
        rows = rows.to(self.device)
        recording = _repeat_state(state, rows.shape[0])   # a copy already
        recording.activate_past_recording()
        positions = torch.arange(start, start + rows.shape[1], device=self.device)[None].expand(rows.shape[0], -1)
        with _recording_states() as states:
            out = self.model(input_ids=rows, position_ids=positions, cache=recording, use_cache=True, output_hidden_states=True)
        self.passes += 1
        self.tokens += rows.numel()
        hidden = torch.stack([out.hidden_states[i + 1] for i in self.taps], dim=2).float()   # [R, L, n, H]
        return Verified(Step(out.logits.float(), hidden, out.cache), rows.shape[1], states)

    @staticmethod
    def commit(verified: Verified, keep: int, row: int | None = None):
        """The state after the first `keep` verified tokens (of `row` for `verify_rows`), from
        the verify pass alone. The verified state is consumed."""
        state = verified.step.state
        state.crop(-(verified.length - keep))   # attention keys/values and recorded conv inputs
        linear = [layer for layer in state.layers if hasattr(layer, "recurrent_states")]
        if keep < verified.length:  # all kept: the verified recurrent states are already the ones
            if len(linear) != len(verified.states):
                raise RuntimeError(f"recorded {len(verified.states)} gated delta rule calls for {len(linear)} "
                                   "linear-attention layers (transformers' qwen3_5 forward changed?)")
            for layer, per_position in zip(linear, verified.states):
                layer.recurrent_states[0] = per_position[keep - 1]
        for layer in linear:
            layer.record_past = False
        if row is not None:
            _select_row(state, row)
        return state

    @staticmethod
    def copy(state):
        return copy.deepcopy(state)


@dataclass
class Verified:
    step: Step
    length: int                        # tokens verified (per row)
    states: list[list[torch.Tensor]]   # per linear-attention layer, its recurrent state after each verified token


def _recording_copy(state):
    recording = copy.deepcopy(state)
    recording.activate_past_recording()
    return recording


@contextlib.contextmanager
def _recording_states():
    """While active, each call of the qwen3_5 chunked gated delta rule also yields the recurrent
    state after every position (appended, one list per call, i.e. per linear-attention layer in
    order), from the single-step rule started at the same initial state. Outputs are the chunked
    rule's, unchanged."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    chunked, single = modeling.torch_chunk_gated_delta_rule, modeling.torch_recurrent_gated_delta_rule
    recorded: list[list[torch.Tensor]] = []

    def recording(query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
        out = chunked(query, key, value, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                      **kwargs)
        states, s = [], initial_state
        for t in range(query.shape[1]):
            _, s = single(query[:, t:t + 1], key[:, t:t + 1], value[:, t:t + 1], g=g[:, t:t + 1], beta=beta[:, t:t + 1],
                          initial_state=s, output_final_state=True,
                          use_qk_l2norm_in_kernel=kwargs.get("use_qk_l2norm_in_kernel", False))
            states.append(s)
        recorded.append(states)
        return out

    modeling.torch_chunk_gated_delta_rule = recording
    try:
        yield recorded
    finally:
        modeling.torch_chunk_gated_delta_rule = chunked


def _map_state_tensors(state, fn) -> None:
    """Replace every state tensor (not scalars) of every cache layer by fn(tensor), in place;
    the layers keep them in attributes, dicts and lists."""
    def apply(value):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return fn(value)
        if isinstance(value, dict):
            return {k: apply(v) for k, v in value.items()}
        if isinstance(value, list):
            return [apply(v) for v in value]
        return value

    for layer in state.layers:
        for name, value in list(vars(layer).items()):
            setattr(layer, name, apply(value))


def _select_row(state, row: int) -> None:
    """Keep batch row `row` of every state tensor (the inverse of `_repeat_state`), in place."""
    _map_state_tensors(state, lambda t: t[row:row + 1].clone())


def _repeat_state(state, rows: int):
    """A copy of a batch-1 cache with every state tensor repeated along the batch dimension."""
    repeated = copy.deepcopy(state)
    _map_state_tensors(repeated, lambda t: t.repeat_interleave(rows, dim=0) if t.shape[0] == 1 else t)
    return repeated
