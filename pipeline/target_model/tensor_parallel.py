"""Tensor-parallel loading of the target with transformers' DistributedConfig.

transformers' default plan for qwen3_5 shards attention q/k/v column-wise by head, which fails
when the KV heads do not divide by the TP size (Qwen3.6-27B: 4 KV heads, TP 8). Our plan keeps
the default for the MLP and the Gated DeltaNet projections and replicates `self_attn` whenever
the KV heads do not divide: the full-attention layers are a quarter of the stack, so the extra
memory is small and the result is exact.
"""

from __future__ import annotations

from pipeline.distributed import Layout

ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def attention_plan(num_key_value_heads: int, tp: int) -> tuple[dict[str, str], str]:
    """(plan overrides, one-line description for the manifest)."""
    from pipeline.target_model.internals import replicated_style

    if num_key_value_heads % tp == 0:
        return {}, f"default (attention sharded by head: {num_key_value_heads} KV heads / tp {tp})"
    overrides = {f"model.layers.*.self_attn.{part}": replicated_style() for part in ATTENTION_PARTS}
    return overrides, f"self_attn replicated ({num_key_value_heads} KV heads do not divide by tp {tp})"


def tp_load_kwargs(layout: Layout, num_key_value_heads: int) -> tuple[dict, str]:
    from pipeline.target_model.internals import distributed_config

    overrides, description = attention_plan(num_key_value_heads, layout.tp)
    config = distributed_config(layout.tp, layout.dp, overrides or "auto")
    return {"distributed_config": config}, description
