"""What changed in transformers across the versions the project supports (pyproject's range), one
adapter per change, each named by what changed. The rest of this package calls these and never
reads a version number: each adapter decides from the feature itself (a signature, an attribute,
an object's type), so a release that back- or forward-ports a change is handled too. The release
each change arrived in is in its comment; tests/target_model/test_transformers_internals.py
checks that every one still finds one of the shapes it knows.

Oldest supported: 5.15 (on 5.14 tree verification's patches of the Gated DeltaNet ops never reach
the layers and kernel provenance finds no binding wrapper). Newest: 5.25. Releases 5.18 to 5.22 are the
ones that install beside vLLM 0.34.
"""

from __future__ import annotations

import functools
import inspect

import torch

from pipeline.errors import PipelineError


def closure_value(fn, name: str):
    """The value `name` has in fn's closure, following `__wrapped__` (functools.wraps) down."""
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is not None and name in code.co_freevars and fn.__closure__:
            return fn.__closure__[code.co_freevars.index(name)].cell_contents
        fn = getattr(fn, "__wrapped__", None)
    return None


# ------------------------------------------------ the forward's cache keyword (5.24)
# 5.24 renamed the forward's `past_key_values=` to `cache=` and the output's `past_key_values` to
# `cache`. Before 5.24 an unknown `cache=` lands in **kwargs and is ignored: decoding would then
# start every pass from an empty cache, so the keyword is read off the signature, never guessed.

@functools.cache
def _cache_keyword_of(forward) -> str:
    params = inspect.signature(forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise PipelineError("this transformers' causal-LM forward takes neither `cache` nor `past_key_values`: "
                        "an unsupported version (see pyproject's transformers range)")


def forward_with_cache(model, cache, **kwargs):
    """(outputs, the cache after the pass): model(..., cache=cache) under the version's names."""
    out = model(**{_cache_keyword_of(type(model).forward): cache}, **kwargs)
    return out, (out.cache if hasattr(out, "cache") else out.past_key_values)


# ------------------------------------------------ data-parallel replicas in DistributedConfig (5.23)
# 5.23 added `dp_replicate_size`: the world is split into tp-sized groups that each hold a whole
# copy of the model. Before it the mesh is the whole world, so tensor parallelism works only with
# one data-parallel group.

def distributed_config(tp: int, dp: int, plan):
    from transformers.distributed import DistributedConfig

    fields = inspect.signature(DistributedConfig).parameters
    if "dp_replicate_size" in fields:
        return DistributedConfig(tp_size=tp, dp_replicate_size=dp, tp_plan=plan)
    if dp > 1:
        import transformers
        raise PipelineError(f"tensor parallelism with {dp} data-parallel groups needs transformers>=5.23 "
                            f"(DistributedConfig's dp_replicate_size); this is {transformers.__version__}: "
                            "upgrade, or launch one data-parallel group (world size = --tp)")
    return DistributedConfig(tp_size=tp, tp_plan=plan)


# ------------------------------------------------ the tensor-parallel style that keeps a layer whole (5.21)
# 5.21 registered "replicate" (every rank holds the whole parameter, inputs and outputs untouched).
# Before it the style that does this at inference is "replicated_with_grad_allreduce" (the same,
# plus a backward hook that all-reduces the gradient: extraction runs no backward). The registry
# moved twice (integrations.tensor_parallel, distributed.tensor_parallel, distributed.parallel_utils).

def replicated_style() -> str:
    import importlib

    for name in ("transformers.distributed.parallel_utils", "transformers.distributed.tensor_parallel",
                 "transformers.integrations.tensor_parallel"):
        try:
            styles = importlib.import_module(name).ALL_PARALLEL_STYLES
        except (ImportError, AttributeError):
            continue
        for style in ("replicate", "replicated_with_grad_allreduce"):
            if style in styles:
                return style
    raise PipelineError("this transformers registers no tensor-parallel style that keeps a layer whole "
                        "(replicate): an unsupported version (see pyproject's transformers range)")


# ------------------------------------------------ the linear-attention cache records its own history (5.25)
# 5.25's linear-attention cache layers can compute and keep the recurrent state after each of the
# last N tokens themselves (`activate_past_recording(recurrent_states_to_keep=N)`; None, the
# default, breaks the forward), keep one state per forward in `recurrent_states_history` while
# recording, and `crop` restores the recurrent state from that history. The project records the
# per-token states itself (tree.recording_states, on every version), so it asks for none and, before
# a crop, gives the layer a history whose entry crop reads is the state it keeps anyway.

@functools.cache
def _keeps_recurrent_states(layer_type) -> bool:
    return "recurrent_states_to_keep" in inspect.signature(layer_type.activate_past_recording).parameters


def _records_recurrent_states(state) -> bool:
    linear = next((layer for layer in state.layers if hasattr(layer, "recurrent_states")), None)
    return linear is not None and _keeps_recurrent_states(type(linear))


def start_recording(state) -> None:
    """Keep the conv inputs of every position fed from now on (until `keep_prefix`/`keep_path`),
    and no recurrent states beyond the last (the project records those itself)."""
    if _records_recurrent_states(state):
        state.activate_past_recording(recurrent_states_to_keep=0)
    else:
        state.activate_past_recording()


def states_of(layer) -> int:
    """How many recurrent states a linear-attention cache layer keeps (5.25 counts them; one before)."""
    return getattr(layer, "number_of_states", 1)


def history_for_crop(layer, removed: int, kept: list[torch.Tensor]) -> None:
    """Before `crop(-removed)` of a recording linear-attention layer: where the layer restores its
    recurrent states from its own history (5.25), make each state's entry the state after the kept
    tokens (`kept[i]`: state i's)."""
    if len(kept) != states_of(layer):
        raise RuntimeError(f"{len(kept)} kept recurrent states for a layer of {states_of(layer)}")
    if removed > 0 and hasattr(layer, "recurrent_states_history"):
        layer.recurrent_states_history = {i: [kept[i]] + [None] * (removed - 1) for i in range(states_of(layer))}


# ------------------------------------------------ the linear-attention ops as modules (5.25 with `kernels`)
# 5.25 passes each op's binding wrapper through the `kernels` package's decorator where that package
# is installed: the module global is then an nn.Module whose forward calls the wrapper (`func` in
# its closure). Without `kernels` it is the wrapper itself, as before 5.25.

def op_function(op):
    """The binding wrapper behind a modeling module's op, whichever form the version gives it. A
    module without `func` in its forward's closure is a form this project does not know: an error,
    never the module itself (the kernel checks would then swap the bound kernel for itself)."""
    if isinstance(op, torch.nn.Module):
        func = closure_value(type(op).forward, "func")
        if func is None:
            raise RuntimeError(f"{type(op).__module__}.{type(op).__qualname__}: a linear-attention op as a module whose "
                               "forward has no `func` in its closure; transformers or `kernels` changed how they wrap "
                               "the ops (pipeline/target_model/internals/versions.py)")
        return func
    return op


def torch_function(op):
    """transformers' torch implementation behind a modeling module's op, whatever it is bound to:
    the wrapper keeps it as `__wrapped__` (functools.wraps)."""
    return inspect.unwrap(op_function(op))


# ------------------------------------------------ the binding falls back to torch by device (5.25)
# 5.25's wrapper keeps the package it bound (fla, causal_conv1d) but runs the torch function for
# inputs on a device that package does not support (CPU): what ran is then torch, whatever was bound.

def runs_bound_kernel_on(wrapper, device_type: str | None) -> bool:
    supported = closure_value(wrapper, "supported_devices")
    return supported is None or device_type is None or device_type in supported


# ------------------------------------------------ hub kernels at load (5.25)
# 5.25 kernelizes every model at `from_pretrained` by default (`use_kernels` None -> True): with the
# `kernels` package that replaces layers by kernels fetched from the Hub for the device (a download;
# offline, a failure), without it the load raises. The project loads the model as written, with the
# kernels bound at import (fla, causal_conv1d, torch: DESIGN 6), on every version: `use_kernels`
# has existed (default False) since before 5.18.
LOAD_WITHOUT_HUB_KERNELS = {"use_kernels": False}
