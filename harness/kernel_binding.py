"""Test scaffolding: run a stage with the qwen3_5 linear-attention ops bound as transformers binds
them on a machine without fla and causal-conv1d, inside a process where fla is installed. The
kernel tier makes a torch shard beside an fla shard this way (DESIGN 6: a cache of mixed kernel
provenance) without a second venv.

Not `pipeline.target_model.internals.torch_fallback`: that puts the bare torch functions in place,
which carry no binding for kernel provenance to read (a cache extracted under it records
"unknown"). Here each op is wrapped again by transformers' own binding decorator, given a package
that cannot be imported, so the wrapper holds the torch function exactly as where fla is absent.
"""

from __future__ import annotations

import contextlib

from pipeline.target_model.internals import LINEAR_ATTENTION_OPS
from pipeline.target_model.internals.versions import torch_function

_ABSENT_PACKAGE = "dflash_kernel_tier_no_such_package"   # importing it fails: transformers falls back to torch


@contextlib.contextmanager
def torch_bound():
    from transformers.integrations import use_kernel_func_from_hub_with_fallback
    from transformers.models.qwen3_5 import modeling_qwen3_5 as module

    saved = {}
    for attr, op in LINEAR_ATTENTION_OPS.items():
        bound = getattr(module, attr, None)
        if bound is None:
            continue
        saved[attr] = bound
        setattr(module, attr, use_kernel_func_from_hub_with_fallback(op, _ABSENT_PACKAGE)(torch_function(bound)))
    try:
        yield
    finally:
        for attr, bound in saved.items():
            setattr(module, attr, bound)
