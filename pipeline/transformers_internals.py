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
from dataclasses import dataclass

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
            if new_valid is None:
                kept = torch.tensor([[True] * len(p) + [False] * (longest - len(p)) for p in paths], device=index.device)
                old = valid if valid is not None else torch.ones(rows, before, dtype=torch.bool, device=index.device)
                new_valid = torch.cat([old.to(index.device), kept], dim=1)
    if new_valid is not None and bool(new_valid.all()):
        return None
    return new_valid


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
    (beta = 0: no write; g = 0: no decay)."""
    chunked = _qwen3_5_modeling().torch_chunk_gated_delta_rule
    longest = max(len(p) for p in paths)
    device = inputs.query.device
    rows = torch.arange(len(paths), device=device)[:, None]
    index = torch.tensor([p + [0] * (longest - len(p)) for p in paths], device=device)
    real = torch.tensor([[True] * len(p) + [False] * (longest - len(p)) for p in paths], device=device)
    g = inputs.g[rows, index] * real[..., None]
    beta = inputs.beta[rows, index] * real[..., None]
    _, state = chunked(inputs.query[rows, index], inputs.key[rows, index], inputs.value[rows, index], g=g, beta=beta,
                       initial_state=inputs.initial, output_final_state=True, use_qk_l2norm_in_kernel=inputs.l2norm)
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


# ---------------------------------------------------------------- loading and the tokenizer

def distributed_config(tp: int, dp: int, plan):
    from transformers.distributed import DistributedConfig

    return DistributedConfig(tp_size=tp, dp_replicate_size=dp, tp_plan=plan)


def qwen3_5_pretokenizer():
    """(the Qwen3.5 tokenizer's pre-tokenization regex, its tokenizer class)."""
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX, Qwen3_5Tokenizer

    return PRETOKENIZE_REGEX, Qwen3_5Tokenizer
