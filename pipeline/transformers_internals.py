"""Every use of transformers' internals, in one module: what the project reads or patches
beyond `from_pretrained`, a plain forward and the public config/tokenizer classes.

- the qwen3_5 modeling module's linear-attention ops (kernel provenance reads which kernel each
  was bound to; extraction counts their calls; speculative decoding swaps the conv and the gated
  delta rule for recording and tree versions while it verifies);
- the cache's layers and their state tensors (speculative decoding copies rows, crops, and keeps
  the accepted path of a verified tree);
- the forward's per-layer-kind `attention_mask` mapping and the attention implementation's mask
  format (tree verification passes an ancestor mask);
- `DistributedConfig` (tensor-parallel loading) and the Qwen3.5 tokenizer's pre-tokenizer regex
  (the embedded tokenizer).

tests/test_transformers_internals.py checks each one by name, so an upgrade that moves one fails
there, naming it, instead of deep inside extract or eval.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys

import torch


def _qwen3_5_modeling():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def modeling_module_of(model):
    """The modeling module a model's layers call their ops through."""
    return sys.modules[type(model).__module__]


# ---------------------------------------------------------------- kernel provenance

# Module-level names in transformers.models.qwen3_5.modeling_qwen3_5 -> the op they implement.
LINEAR_ATTENTION_OPS = {
    "torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule",
    "causal_conv1d_fn": "causal_conv1d_fn",
    "causal_conv1d_update": "causal_conv1d_update",
}


def _closure_value(fn, name: str):
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is not None and name in code.co_freevars and fn.__closure__:
            return fn.__closure__[code.co_freevars.index(name)].cell_contents
        fn = getattr(fn, "__wrapped__", None)
    return None


def _kind(impl) -> str:
    module = getattr(impl, "__module__", "") or ""
    if module.startswith("fla"):
        return "fla"
    if module.startswith("causal_conv1d"):
        return "causal_conv1d"
    if module.startswith("kernels") or "hub" in module:
        return "hub-kernel"
    return "torch"


def bound_kernels(modeling_module) -> dict:
    """{op: {kind, implementation}}. The wrapper copies the torch function's name onto itself, so
    only its closure tells what it dispatches to: without that closure (transformers renamed its
    internals, or stopped wrapping) the kind is "unknown", never a guess from the name."""
    out = {}
    for attr, op in LINEAR_ATTENTION_OPS.items():
        fn = getattr(modeling_module, attr, None)
        if fn is None:
            continue
        impl = _closure_value(getattr(fn, "_counted_original", fn), "implementation")
        if impl is None:
            out[op] = {"kind": "unknown", "implementation": f"undetermined ({attr} has no 'implementation' closure)"}
            continue
        out[op] = {"kind": _kind(impl), "implementation": f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', '?')}"}
    return out


class KernelCallCounter:
    """Counts calls of each linear-attention op while active (patches the module globals)."""

    def __init__(self, model):
        self.module = sys.modules[type(model).__module__]
        self.counts = {op: 0 for attr, op in LINEAR_ATTENTION_OPS.items() if hasattr(self.module, attr)}
        self._saved: dict[str, object] = {}

    def __enter__(self):
        for attr, op in LINEAR_ATTENTION_OPS.items():
            original = getattr(self.module, attr, None)
            if original is None:
                continue
            self._saved[attr] = original

            @functools.wraps(original)
            def counted(*args, __op=op, __fn=original, **kwargs):
                self.counts[__op] += 1
                return __fn(*args, **kwargs)

            counted._counted_original = original
            setattr(self.module, attr, counted)
        return self

    def __exit__(self, *exc):
        for attr, original in self._saved.items():
            setattr(self.module, attr, original)
        self._saved.clear()

# ---------------------------------------------------------------- the cache's layers

def is_linear_attention(layer) -> bool:
    return hasattr(layer, "recurrent_states")


def start_recording(state) -> None:
    """Keep the conv inputs of every position fed from now on (until `keep_prefix`/`keep_path`)."""
    state.activate_past_recording()


def keep_prefix(state, length: int, keep: int, per_position: list[list[torch.Tensor]]) -> None:
    """Cut a recorded pass of `length` tokens back to its first `keep`: keys/values and conv
    inputs cropped, each linear-attention layer's recurrent state set to the one after the last
    kept token (`per_position`: per linear-attention layer, the state after each token)."""
    state.crop(-(length - keep))
    linear = [layer for layer in state.layers if is_linear_attention(layer)]
    if keep < length:  # all kept: the pass's recurrent states are already the ones
        if len(linear) != len(per_position):
            raise RuntimeError(f"recorded {len(per_position)} gated delta rule calls for {len(linear)} "
                               "linear-attention layers (transformers' qwen3_5 forward changed?)")
        for layer, states in zip(linear, per_position):
            layer.recurrent_states[0] = states[keep - 1]
    for layer in linear:
        layer.record_past = False


def keep_path(state, length: int, path: list[int], per_token: list[list[torch.Tensor]]) -> None:
    """Cut a recorded tree pass of `length` tokens down to the tokens `path` (a root path): their
    keys/values and conv inputs kept in path order, each recurrent state the one after the
    path's last token."""
    kept = torch.tensor(path, dtype=torch.long)
    linear = iter(per_token)
    for layer in state.layers:
        if is_linear_attention(layer):
            states = next(linear, None)
            if states is None:
                raise RuntimeError("fewer recorded tree recurrences than linear-attention layers "
                                   "(transformers' qwen3_5 forward changed?)")
            conv = layer.conv_states[0]
            before = conv.shape[-1] - length
            path_inputs = torch.cat([conv[..., :before], conv[..., before + kept.to(conv.device)]], dim=-1)
            layer.conv_states[0] = path_inputs[..., -layer.conv_kernel_size[0]:].contiguous()
            layer.recurrent_states[0] = states[path[-1]]
            layer.record_past = False
        elif getattr(layer, "keys", None) is not None:
            before = layer.keys.shape[-2] - length
            index = torch.cat([torch.arange(before), before + kept]).to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)


def map_state_tensors(state, fn) -> None:
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


def select_row(state, row: int) -> None:
    """Keep batch row `row` of every state tensor (the inverse of `repeat_state`), in place."""
    map_state_tensors(state, lambda t: t[row:row + 1].clone())


def repeat_state(state, rows: int):
    """A copy of a batch-1 cache with every state tensor repeated along the batch dimension."""
    repeated = copy.deepcopy(state)
    map_state_tensors(repeated, lambda t: t.repeat_interleave(rows, dim=0) if t.shape[0] == 1 else t)
    return repeated


# ---------------------------------------------------------------- the forward, patched while verifying

def tree_attention_masks(model, visible: torch.Tensor) -> dict:
    """The forward's `attention_mask` for a tree: per layer kind, the [1, 1, N, T + N] visibility as
    the attention implementation takes a mask (full attention), none for linear attention."""
    implementation = model.config._attn_implementation
    if implementation == "sdpa":
        return {"full_attention": visible, "linear_attention": None}
    if implementation == "eager":
        additive = torch.zeros(visible.shape, dtype=model.dtype, device=visible.device).masked_fill(
            ~visible, torch.finfo(model.dtype).min)
        return {"full_attention": additive, "linear_attention": None}
    raise ValueError(f"tree verification needs an attention implementation that takes a mask (sdpa, eager); "
                     f"the target runs {implementation!r}: use the batched-paths verification")


def takes_tree_mask(model) -> bool:
    return model.config._attn_implementation in ("sdpa", "eager")


@contextlib.contextmanager
def tree_rules(parents: list[int]):
    """While active, the qwen3_5 Gated DeltaNet layers treat their sequence as the token tree
    given by `parents` (the root first): the causal conv of a token reads its ancestors' inputs
    (back into the committed conv state past the root), and the gated delta rule runs depth by
    depth, each token's recurrent state stepped from its parent's with the single-step rule
    (the one a one-token decode uses). Each layer's per-token states are appended to the
    yielded list, one list per linear-attention layer in order."""
    modeling = _qwen3_5_modeling()

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


# ---------------------------------------------------------------- loading and the tokenizer

def distributed_config(tp: int, dp: int, plan):
    from transformers.distributed import DistributedConfig

    return DistributedConfig(tp_size=tp, dp_replicate_size=dp, tp_plan=plan)


def qwen3_5_pretokenizer():
    """(the Qwen3.5 tokenizer's pre-tokenization regex, its tokenizer class)."""
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX, Qwen3_5Tokenizer

    return PRETOKENIZE_REGEX, Qwen3_5Tokenizer
