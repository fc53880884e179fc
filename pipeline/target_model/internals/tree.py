"""The transformers internals that speculative decoding patches while it verifies (the other half
of pipeline/target_model/internals/__init__.py, split by job): the qwen3_5 modeling module's causal conv and
gated delta rule, swapped for a tree version (`tree_rules`: row b of the batch is a token tree)
or a recording version (`recording_states`: the recurrent state after every verified position),
and the cache cut down to each row's accepted tree path (`keep_path`, `path_states`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from pipeline.target_model.internals import _qwen3_5_modeling, is_linear_attention


@dataclass
class TreeStepInputs:
    """What one linear-attention layer's gated delta rule got for a tree pass: its initial
    (committed) state per row and each token's step inputs. The state after any root path is
    re-derived from these (`path_states`): keeping every token's state instead would cost
    budget x heads x key dim x value dim per layer (about 10 GB at Qwen3.6-27B, budget 64)."""
    initial: torch.Tensor | None   # [B, H, Dk, Dv]
    query: torch.Tensor            # [B, n, H, Dk] (key heads; the rule repeats them)
    key: torch.Tensor
    value: torch.Tensor            # [B, n, Hv, Dv]
    g: torch.Tensor                # [B, n, Hv]
    beta: torch.Tensor
    l2norm: bool


def _depths(parents: list[int]) -> list[int]:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


@contextlib.contextmanager
def tree_rules(parents: list[list[int]]):
    """While active, the qwen3_5 Gated DeltaNet layers treat row b of their batch as the token tree
    given by `parents[b]` (the root first; every row has the same number of tokens): the causal
    conv of a token reads its ancestors' inputs (back into the committed conv state past the
    root), and the gated delta rule runs depth by depth over all rows at once, each token's
    recurrent state stepped from its parent's with the single-step rule (the one a one-token
    decode uses). Yields a list that receives each linear-attention layer's `TreeStepInputs`, in
    order."""
    modeling = _qwen3_5_modeling()

    conv_fn, chunked, single = modeling.causal_conv1d_fn, modeling.torch_chunk_gated_delta_rule, \
        modeling.torch_recurrent_gated_delta_rule
    rows, n = len(parents), len(parents[0])
    depths = [_depths(p) for p in parents]
    levels, slot = [], {}   # per depth: (rows, tokens, the parents' slots in the level above)
    for d in range(max(max(x) for x in depths) + 1):
        pairs = [(b, i) for b in range(rows) for i in range(n) if depths[b][i] == d]
        above = [slot[(b, parents[b][i])] for b, i in pairs] if d else None
        levels.append(([b for b, _ in pairs], [i for _, i in pairs], above))
        slot = {pair: k for k, pair in enumerate(pairs)}
    recorded: list[TreeStepInputs] = []

    def tree_conv(x, weight, bias=None, activation=None, **kwargs):
        # x: [B, C, P + n] = the committed conv inputs (the last P = kernel size) then the tree's.
        kernel, before = weight.shape[-1], x.shape[-1] - n
        windows = []
        for b in range(rows):
            row = []
            for i in range(n):
                window, node, back = [], i, before - 1
                while len(window) < kernel:
                    if node >= 0:
                        window.append(before + node)
                        node = parents[b][node]
                    else:
                        window.append(max(back, 0))
                        back -= 1
                row.append(window[::-1])
            windows.append(row)
        index = torch.tensor(windows, device=x.device)                                      # [B, n, kernel]
        taps = x.transpose(1, 2)[torch.arange(rows, device=x.device)[:, None, None], index]  # [B, n, kernel, C]
        out = torch.einsum("bnkc,ck->bcn", taps.to(weight.dtype), weight)
        if bias is not None:
            out = out + bias[None, :, None]
        if activation is not None:
            out = modeling.ACT2FN[activation](out)
        return torch.cat([x.new_zeros(*x.shape[:2], before), out.to(x.dtype)], dim=-1)  # the forward keeps the last n

    def tree_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kwargs):
        out, above = None, None
        for level_rows, tokens, parent_slots in levels:
            b = torch.tensor(level_rows, device=query.device)
            i = torch.tensor(tokens, device=query.device)
            if parent_slots is None:
                start = None if initial_state is None else initial_state[b]
            else:
                start = above[torch.tensor(parent_slots, device=query.device)]
            o, above = single(query[b, i, None], key[b, i, None], value[b, i, None], g=g[b, i, None], beta=beta[b, i, None],
                              initial_state=start, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            if out is None:
                out = o.new_zeros(rows, n, *o.shape[2:])
            out[b, i] = o[:, 0]
        recorded.append(TreeStepInputs(initial_state, query, key, value, g, beta, use_qk_l2norm_in_kernel))
        # The cache keeps its committed state until keep_path sets the path's.
        final = initial_state if initial_state is not None else torch.zeros_like(above[:1]).expand(rows, *above.shape[1:])
        return out, (final if output_final_state else None)

    modeling.causal_conv1d_fn, modeling.torch_chunk_gated_delta_rule = tree_conv, tree_rule
    try:
        yield recorded
    finally:
        modeling.causal_conv1d_fn, modeling.torch_chunk_gated_delta_rule = conv_fn, chunked


def path_states(inputs: TreeStepInputs, paths: list[list[int]]) -> torch.Tensor:
    """[B, H, Dk, Dv]: each row's recurrent state after the tokens `paths[b]` of its tree, from
    the committed state: one chunked gated delta rule call over the paths' step inputs (the
    kernel a prefill uses; fla's on a GPU), shorter paths padded with steps that change nothing
    (beta = 0: no write; g = 0: no decay). The torch rule pads to its chunk, 64 tokens by default;
    a path is at most a block, so the chunk is the paths' length rounded up to a power of two (the
    1,000-sample speculative sampling test spent 22 of its 47 s padding paths of 5 to 64). fla's
    kernel, on a GPU, takes no chunk size: transformers' wrapper drops the arguments a kernel
    does not take."""
    chunked = _qwen3_5_modeling().torch_chunk_gated_delta_rule
    longest = max(len(p) for p in paths)
    chunk = 1 << (longest - 1).bit_length()
    device = inputs.query.device
    rows = torch.arange(len(paths), device=device)[:, None]
    index = torch.tensor([p + [0] * (longest - len(p)) for p in paths], device=device)
    real = torch.tensor([[True] * len(p) + [False] * (longest - len(p)) for p in paths], device=device)
    g = inputs.g[rows, index] * real[..., None]
    beta = inputs.beta[rows, index] * real[..., None]
    _, state = chunked(inputs.query[rows, index], inputs.key[rows, index], inputs.value[rows, index], g=g, beta=beta,
                       chunk_size=chunk, initial_state=inputs.initial, output_final_state=True,
                       use_qk_l2norm_in_kernel=inputs.l2norm)
    return state


@contextlib.contextmanager
def recording_states():
    """While active, the qwen3_5 chunked gated delta rule is run as the single-step rule over the
    (few) verified positions, which gives the recurrent state after every position (appended,
    one list per call, i.e. per linear-attention layer in order) and the outputs a one-token
    decode computes. For a short block on the CPU this is also faster than the chunked rule,
    which pads to its chunk of 64."""
    modeling = _qwen3_5_modeling()

    chunked, single = modeling.torch_chunk_gated_delta_rule, modeling.torch_recurrent_gated_delta_rule
    recorded: list[list[torch.Tensor]] = []

    def recording(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kwargs):
        outputs, states, s = [], [], initial_state
        for t in range(query.shape[1]):
            o, s = single(query[:, t:t + 1], key[:, t:t + 1], value[:, t:t + 1], g=g[:, t:t + 1], beta=beta[:, t:t + 1],
                          initial_state=s, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            outputs.append(o)
            states.append(s)
        recorded.append(states)
        return torch.cat(outputs, dim=1), (s if output_final_state else None)

    modeling.torch_chunk_gated_delta_rule = recording
    try:
        yield recorded
    finally:
        modeling.torch_chunk_gated_delta_rule = chunked


def keep_path(state, length: int, paths: list[list[int]], inputs: list[TreeStepInputs],
              valid: torch.Tensor | None) -> torch.Tensor | None:
    """Cut a recorded tree pass of `length` tokens per row down to each row's root path
    `paths[b]`: their keys/values and conv inputs kept in path order, each recurrent state the
    one after the path's last token. `valid` [B, T]: which committed key/value slots are real
    (None: all). Rows keep paths of different lengths, so a row's keys/values are padded to the
    longest with slots marked invalid; returns the new `valid` (None when every slot is real)."""
    rows, longest = len(paths), max(len(p) for p in paths)
    linear = iter(inputs)
    new_valid = None
    for layer in state.layers:
        if is_linear_attention(layer):
            recorded = next(linear, None)
            if recorded is None:
                raise RuntimeError("fewer recorded tree recurrences than linear-attention layers "
                                   "(transformers' qwen3_5 forward changed?)")
            conv = layer.conv_states[0]
            before, kernel = conv.shape[-1] - length, layer.conv_kernel_size[0]
            index = torch.tensor([(list(range(before)) + [before + i for i in p])[-kernel:] for p in paths],
                                 device=conv.device)
            layer.conv_states[0] = conv.gather(-1, index[:, None, :].expand(-1, conv.shape[1], -1)).contiguous()
            layer.recurrent_states[0] = path_states(recorded, paths)
            layer.record_past = False
        elif getattr(layer, "keys", None) is not None:
            before = layer.keys.shape[-2] - length
            index = torch.tensor([list(range(before)) + [before + i for i in p] + [before + p[-1]] * (longest - len(p))
                                  for p in paths], device=layer.keys.device)
            expand = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(-2, expand), layer.values.gather(-2, expand)
            if new_valid is None:   # on the host, as `Rows.valid` always is
                kept = torch.tensor([[True] * len(p) + [False] * (longest - len(p)) for p in paths])
                old = valid.cpu() if valid is not None else torch.ones(rows, before, dtype=torch.bool)
                new_valid = torch.cat([old, kept], dim=1)
    if new_valid is not None and bool(new_valid.all()):   # a host tensor: no device sync
        return None
    return new_valid
