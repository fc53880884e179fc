"""Every use of transformers' internals, in one package (this module, tree.py and versions.py):
what the project reads or patches beyond `from_pretrained`, a plain forward and the public
config/tokenizer classes.

- the qwen3_5 modeling module's linear-attention ops (kernel provenance reads which kernel each
  was bound to; extraction counts their calls; speculative decoding swaps the conv and the gated
  delta rule for recording and tree versions while it verifies);
- the cache's layers and their state tensors (speculative decoding copies rows, crops, and keeps
  the accepted path of a verified tree);
- the forward's per-layer-kind `attention_mask` mapping and the attention implementation's mask
  format (tree verification passes an ancestor mask);
- `DistributedConfig` (tensor-parallel loading) and the Qwen3.5 tokenizer's pre-tokenizer regex
  (the embedded tokenizer).

The tree-verification versions of the linear-attention ops, which patch the same modeling
module, are in tree.py; what differs between the supported transformers releases is in
versions.py, one adapter per change. tests/target_model/test_transformers_internals.py checks each
one by name, so an upgrade that moves one fails there, naming it, instead of deep inside extract or
eval.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys

import torch

from pipeline.target_model.internals import versions
from pipeline.target_model.internals.versions import (LOAD_WITHOUT_HUB_KERNELS, distributed_config, forward_with_cache,
                                                      replicated_style, start_recording)

__all__ = ["LINEAR_ATTENTION_OPS", "LOAD_WITHOUT_HUB_KERNELS", "KernelCallCounter", "attention_masks", "bound_kernels",
           "distributed_config", "forward_with_cache", "is_linear_attention", "keep_prefix", "keep_rows",
           "map_state_tensors", "modeling_module_of", "qwen3_5_pretokenizer", "repeat_state", "replicated_style", "select_row",
           "stack_rows", "start_recording", "takes_mask", "torch_fallback"]


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


def _kind(impl) -> str:
    module = getattr(impl, "__module__", "") or ""
    if module.startswith("fla"):
        return "fla"
    if module.startswith("causal_conv1d"):
        return "causal_conv1d"
    if module.startswith("kernels") or "hub" in module:
        return "hub-kernel"
    return "torch"


def bound_kernels(modeling_module, device_type: str | None = None) -> dict:
    """{op: {kind, implementation}}. The wrapper copies the torch function's name onto itself, so
    only its closure tells what it dispatches to: without that closure (transformers renamed its
    internals, or stopped wrapping) the kind is "unknown", never a guess from the name. Given the
    device the model runs on, a package bound for an op but not run there (transformers falls
    back to torch by device) is reported as torch, with what was bound."""
    out = {}
    for attr, op in LINEAR_ATTENTION_OPS.items():
        fn = getattr(modeling_module, attr, None)
        if fn is None:
            continue
        try:
            wrapper = versions.op_function(getattr(fn, "_counted_original", fn))
        except RuntimeError as e:  # a form not known: reported, never guessed
            out[op] = {"kind": "unknown", "implementation": f"undetermined ({e})"}
            continue
        impl = versions.closure_value(wrapper, "implementation")
        if impl is None:
            out[op] = {"kind": "unknown", "implementation": f"undetermined ({attr} has no 'implementation' closure)"}
            continue
        kind, name = _kind(impl), f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', '?')}"
        if kind != "torch" and not versions.runs_bound_kernel_on(wrapper, device_type):
            kind, name = "torch", f"{name} bound, torch on {device_type}"
        out[op] = {"kind": kind, "implementation": name}
    return out


def _named_after(op):
    """What a counting wrapper takes its name from: the binding wrapper, or the op itself where its
    form is not known (counting still works; `bound_kernels` reports such an op as unknown)."""
    try:
        return versions.op_function(op)
    except RuntimeError:
        return op


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

            @functools.wraps(_named_after(original))
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

@contextlib.contextmanager
def torch_fallback(model):
    """Within: the model's linear-attention ops run transformers' torch reference implementations
    whatever was bound at import (fla, causal_conv1d, a hub kernel): the reference that a GPU
    check compares the kernels with. The wrapper keeps the torch function as `__wrapped__`."""
    module = modeling_module_of(model)
    saved = {}
    for attr in LINEAR_ATTENTION_OPS:
        fn = getattr(module, attr, None)
        if fn is not None:
            saved[attr] = fn
            setattr(module, attr, versions.torch_function(fn))
    try:
        yield
    finally:
        for attr, fn in saved.items():
            setattr(module, attr, fn)


# ---------------------------------------------------------------- the cache's layers

def is_linear_attention(layer) -> bool:
    return hasattr(layer, "recurrent_states")


def keep_prefix(state, length: int, keep: int, per_position: list[list[torch.Tensor]]) -> None:
    """Cut a recorded pass of `length` tokens back to its first `keep`: keys/values and conv
    inputs cropped, each linear-attention layer's recurrent state set to the one after the last
    kept token (`per_position`: per gated delta rule call, the state after each token; the calls
    of a pass come layer by layer, and within a layer of several states, state by state)."""
    linear = [layer for layer in state.layers if is_linear_attention(layer)]
    if keep < length:  # all kept: the pass's recurrent states are already the ones
        counts = [versions.states_of(layer) for layer in linear]
        if sum(counts) != len(per_position):
            raise RuntimeError(f"recorded {len(per_position)} gated delta rule calls for {len(linear)} "
                               f"linear-attention layers of {sum(counts)} recurrent states (transformers' qwen3_5 "
                               "forward changed?)")
        starts = [sum(counts[:k]) for k in range(len(counts))]
        kept = [[calls[keep - 1] for calls in per_position[a:a + n]] for a, n in zip(starts, counts)]
        for layer, states in zip(linear, kept):
            versions.history_for_crop(layer, length - keep, states)
    state.crop(-(length - keep))
    if keep < length:
        for layer, states in zip(linear, kept):
            for i, s in enumerate(states):
                layer.recurrent_states[i] = s
    for layer in linear:
        layer.record_past = False


def stack_rows(states: list, lengths: list[int]):
    """One cache whose row b is the batch-1 cache `states[b]` of a sequence of lengths[b] tokens:
    linear-attention states concatenated, keys/values right-padded to the longest (the padding
    marked invalid). Returns (cache, valid [B, T] or None). The states are consumed."""
    merged, longest = states[0], max(lengths)
    for i, layer in enumerate(merged.layers):
        layers = [s.layers[i] for s in states]
        if is_linear_attention(layer):
            layer.conv_states[0] = torch.cat([x.conv_states[0] for x in layers])
            layer.recurrent_states[0] = torch.cat([x.recurrent_states[0] for x in layers])
        elif getattr(layer, "keys", None) is not None:
            pad = [longest - x.keys.shape[-2] for x in layers]
            layer.keys = torch.cat([torch.nn.functional.pad(x.keys, (0, 0, 0, p)) for x, p in zip(layers, pad)])
            layer.values = torch.cat([torch.nn.functional.pad(x.values, (0, 0, 0, p)) for x, p in zip(layers, pad)])
    valid = torch.arange(longest)[None] < torch.tensor(lengths)[:, None]
    return merged, (None if bool(valid.all()) else valid)


def keep_rows(state, rows: list[int], valid: torch.Tensor | None):
    """Rows `rows` of a batched cache, in place; key/value slots no kept row uses are dropped.
    Returns the kept rows' `valid`."""
    index = torch.tensor(rows)
    map_state_tensors(state, lambda t: t.index_select(0, index.to(t.device)))
    if valid is None:
        return None
    valid = valid[index]
    used = valid.any(0)
    if not bool(used.all()):
        columns = used.nonzero()[:, 0]
        for layer in state.layers:
            if not is_linear_attention(layer) and getattr(layer, "keys", None) is not None:
                layer.keys = layer.keys.index_select(-2, columns.to(layer.keys.device))
                layer.values = layer.values.index_select(-2, columns.to(layer.values.device))
        valid = valid[:, columns]
    return None if bool(valid.all()) else valid


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

def attention_masks(model, visible: torch.Tensor) -> dict:
    """The forward's `attention_mask` from a [B, 1, Q, T + Q] visibility (a tree's ancestors, rows'
    real key/value slots): per layer kind, as the attention implementation takes a mask (full
    attention), none for linear attention."""
    implementation = model.config._attn_implementation
    if implementation == "sdpa":
        return {"full_attention": visible, "linear_attention": None}
    if implementation == "eager":
        additive = torch.zeros(visible.shape, dtype=model.dtype, device=visible.device).masked_fill(
            ~visible, torch.finfo(model.dtype).min)
        return {"full_attention": additive, "linear_attention": None}
    raise ValueError(f"tree verification and batched rows need an attention implementation that takes a mask "
                     f"(sdpa, eager); the target runs {implementation!r}")


def takes_mask(model) -> bool:
    return model.config._attn_implementation in ("sdpa", "eager")


# ---------------------------------------------------------------- loading and the tokenizer

def qwen3_5_pretokenizer():
    """(the Qwen3.5 tokenizer's pre-tokenization regex, its tokenizer class)."""
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX, Qwen3_5Tokenizer

    return PRETOKENIZE_REGEX, Qwen3_5Tokenizer
