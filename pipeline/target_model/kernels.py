"""Kernel provenance for the linear-attention ops of transformers' qwen3_5 modeling (DESIGN 6):
transformers binds each op at import time (hub kernels, then fla / causal_conv1d, then the torch
reference) inside a wrapper closure. `bound_kernels` reads what was bound; `KernelCallCounter`
counts what was actually called during a forward, by wrapping the module globals the layers call
through (both in internals/); `kernel_record` puts them together for the cache's records."""

from __future__ import annotations

from pipeline.target_model.internals import bound_kernels, modeling_module_of


def kernel_record(model, counts: dict[str, int]) -> dict:
    """Per op: what was bound and how often it ran; plus a one-word path for quick comparison."""
    parameter = next(iter(model.parameters()), None)
    bound = bound_kernels(modeling_module_of(model), None if parameter is None else parameter.device.type)
    ops = {op: {**info, "calls": counts.get(op, 0)} for op, info in bound.items()}
    called = sorted({info["kind"] for info in ops.values() if info["calls"]})
    linear = "linear_attention" in (getattr(getattr(model, "config", None), "layer_types", None) or [])
    if linear and (not bound or any(info["kind"] == "unknown" for info in bound.values())):
        return {"ops": ops, "path": "unknown"}  # linear attention ran through code we cannot identify
    return {"ops": ops, "path": "+".join(called) if called else "none"}
