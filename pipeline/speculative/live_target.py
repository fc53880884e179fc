"""The live target during speculative decoding: its cache, its tapped hidden states, and exact rollback.

Gated DeltaNet layers keep a recurrent state that only moves forward: after verifying B draft
tokens, cropping the KV cache of the attention layers does not bring the recurrent state back
to the last accepted token. So a block verification (`verify`, `verify_rows`) records what a
rollback needs: transformers' cache keeps the conv inputs of every verified position
(`activate_past_recording`), and the gated delta rule's state after each verified position is
computed alongside the verify pass (the chunked rule gives only the last; `_recording_states`
steps the recurrent rule over the few verified tokens from the same initial state). `commit`
then crops the cache to the accepted tokens and sets each recurrent state to the one after the
last accepted token: no second target pass (tested against re-running the accepted tokens on
the committed state, which is what decoding did before).

A draft tree is verified in one pass over its nodes (`verify_tree`): the attention layers take
an ancestor mask over the committed cache plus the tree, and the Gated DeltaNet layers run as a
tree (`_tree_rules`: each node's conv window is its ancestors' inputs, its recurrent state is
stepped from its parent's). `commit_path` keeps the accepted path's keys/values, conv inputs
and last recurrent state. Tested against `verify_rows` over the tree's root-to-leaf paths.

This module is where the speculative decoder touches transformers' internals (the cache's layers
and their states, the qwen3_5 modeling module's conv and gated delta rule functions, the
attention mask the forward takes per layer kind); tests/test_transformers_internals.py names
each one.
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
        """`run` with `state` recording: `commit` can then keep any prefix of `tokens`. `state` is
        consumed (no copy of the whole cache per step; the committed state comes from `commit`)."""
        state.activate_past_recording()
        with _recording_states() as states:
            step = self.run(tokens, state, start, with_hidden=with_hidden)
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

    @torch.no_grad()
    def verify_tree(self, tokens: list[int], parents: list[int], state, start: int) -> TreeVerified:
        """One target pass over a token tree continuing `state`, each token processed once.
        tokens[0] is the root (at position `start`), parents[i] < i is token i's parent (-1 for
        the root). Full-attention layers see the committed cache plus the token's ancestors
        (an ancestor mask); linear-attention layers start each token from its parent's
        recurrent state and convolve over its ancestors' inputs (`_tree_rules`). Logits [N, V]
        and tapped hidden states [N, n, H] per token; `commit_path` keeps one root path.
        `state` is consumed (the committed state comes from `commit_path`)."""
        n = len(tokens)
        if len(parents) != n or parents[0] != -1 or any(not 0 <= parents[i] < i for i in range(1, n)):
            raise ValueError("parents: the root first (-1), then each token after its parent")
        depth = [0] * n
        ancestry = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
            ancestry[i] |= ancestry[parents[i]]
        committed = torch.ones(n, start, dtype=torch.bool)
        visible = torch.cat([committed, ancestry], dim=1)[None, None].to(self.device)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        positions = (start + torch.tensor(depth, device=self.device))[None]
        state.activate_past_recording()   # the conv inputs of every tree token stay until commit_path
        with _tree_rules(parents) as states:
            out = self.model(input_ids=ids, position_ids=positions, cache=state, use_cache=True, output_hidden_states=True,
                             attention_mask={"full_attention": _attention_mask(self.model, visible),
                                             "linear_attention": None})
        self.passes += 1
        self.tokens += n
        hidden = torch.stack([out.hidden_states[i + 1][0] for i in self.taps], dim=1).float()
        return TreeVerified(Step(out.logits[0].float(), hidden, out.cache), n, states)

    @staticmethod
    def commit_path(verified: TreeVerified, path: list[int]):
        """The state after the tree tokens `path` (the root, then each next one a child of the one
        before), from the tree pass alone: the path's keys/values and conv inputs are kept, each
        recurrent state is the one after the path's last token."""
        state, n = verified.step.state, verified.length
        kept = torch.tensor(path, dtype=torch.long)
        linear = iter(verified.states)
        for layer in state.layers:
            if hasattr(layer, "recurrent_states"):
                per_token = next(linear, None)
                if per_token is None:
                    raise RuntimeError("fewer recorded tree recurrences than linear-attention layers "
                                       "(transformers' qwen3_5 forward changed?)")
                conv = layer.conv_states[0]
                before = conv.shape[-1] - n
                path_inputs = torch.cat([conv[..., :before], conv[..., before + kept.to(conv.device)]], dim=-1)
                layer.conv_states[0] = path_inputs[..., -layer.conv_kernel_size[0]:].contiguous()
                layer.recurrent_states[0] = per_token[path[-1]]
                layer.record_past = False
            elif getattr(layer, "keys", None) is not None:
                before = layer.keys.shape[-2] - n
                index = torch.cat([torch.arange(before), before + kept]).to(layer.keys.device)
                layer.keys = layer.keys.index_select(-2, index)
                layer.values = layer.values.index_select(-2, index)
        return state

    @staticmethod
    def copy(state):
        return copy.deepcopy(state)


@dataclass
class Verified:
    step: Step
    length: int                        # tokens verified (per row)
    states: list[list[torch.Tensor]]   # per linear-attention layer, its recurrent state after each verified token


@dataclass
class TreeVerified:
    step: Step
    length: int                        # tree tokens, the root included
    states: list[list[torch.Tensor]]   # per linear-attention layer, its recurrent state after each tree token


def _attention_mask(model, visible: torch.Tensor) -> torch.Tensor:
    """The tree's [1, 1, N, T + N] visibility as the model's attention function takes a mask."""
    implementation = model.config._attn_implementation
    if implementation == "sdpa":
        return visible
    if implementation == "eager":
        return torch.zeros(visible.shape, dtype=model.dtype, device=visible.device).masked_fill(
            ~visible, torch.finfo(model.dtype).min)
    raise ValueError(f"tree verification needs an attention implementation that takes a mask (sdpa, eager); "
                     f"the target runs {implementation!r}: use the batched-paths verification")


@contextlib.contextmanager
def _tree_rules(parents: list[int]):
    """While active, the qwen3_5 Gated DeltaNet layers treat their sequence as the token tree
    given by `parents` (the root first): the causal conv of a token reads its ancestors' inputs
    (back into the committed conv state past the root), and the gated delta rule runs depth by
    depth, each token's recurrent state stepped from its parent's with the single-step rule
    (the one a one-token decode uses). Each layer's per-token states are appended to the
    yielded list, one list per linear-attention layer in order."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    conv_fn, chunked, single = modeling.causal_conv1d_fn, modeling.torch_chunk_gated_delta_rule, \
        modeling.torch_recurrent_gated_delta_rule
    n = len(parents)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    levels = [[i for i in range(n) if depth[i] == d] for d in range(max(depth) + 1)]
    recorded: list[list[torch.Tensor]] = []

    def tree_conv(x, weight, bias=None, activation=None, **kwargs):
        # x: [1, C, P + n] = the committed conv inputs (the last P = kernel size) then the tree's.
        kernel, before = weight.shape[-1], x.shape[-1] - n
        windows = []
        for i in range(n):
            window, node, back = [], i, before - 1
            while len(window) < kernel:
                if node >= 0:
                    window.append(before + node)
                    node = parents[node]
                else:
                    window.append(max(back, 0))
                    back -= 1
            windows.append(window[::-1])
        taps = x.to(weight.dtype)[:, :, torch.tensor(windows, device=x.device)]   # [1, C, n, kernel]
        out = (taps * weight[None, :, None, :]).sum(-1)
        if bias is not None:
            out = out + bias[None, :, None]
        if activation is not None:
            out = modeling.ACT2FN[activation](out)
        return torch.cat([x.new_zeros(*x.shape[:2], before), out.to(x.dtype)], dim=-1)  # the forward keeps the last n

    def tree_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kwargs):
        states: list[torch.Tensor | None] = [None] * n
        out = None
        for level in levels:
            index = torch.tensor(level, device=query.device)
            start = initial_state if level == [0] else torch.cat([states[parents[i]] for i in level])
            o, s = single(query[0, index, None], key[0, index, None], value[0, index, None], g=g[0, index, None],
                          beta=beta[0, index, None], initial_state=start, output_final_state=True,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            if out is None:
                out = o.new_zeros(1, n, *o.shape[2:])
            out[0, index] = o[:, 0]
            for k, i in enumerate(level):
                states[i] = s[k:k + 1]
        recorded.append(states)
        return out, (states[-1] if output_final_state else None)

    modeling.causal_conv1d_fn, modeling.torch_chunk_gated_delta_rule = tree_conv, tree_rule
    try:
        yield recorded
    finally:
        modeling.causal_conv1d_fn, modeling.torch_chunk_gated_delta_rule = conv_fn, chunked


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
