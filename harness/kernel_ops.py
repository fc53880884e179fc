"""fla's linear-attention kernels and transformers' torch functions for qwen3_5 on the same inputs,
op by op: the pairs that tests/kernels/test_ops.py asserts on, benchmarks/kernels/interpreter_table.py
prints, and benchmarks/gpu/gpu_check.py measures on a GPU. The reference is always transformers'
own torch function (the fallback its qwen3_5 layers bind without fla), read unwrapped from the
modeling module, so the comparison holds whatever transformers bound at import.

Shapes are the embedded target's Gated DeltaNet (2 key heads, 4 value heads of dim 64, conv kernel
4) unless given: grouped value heads, as Qwen3.6-27B has. 100 tokens: one full chunk of fla's 64
and a partial one. Inputs are made on the host from a seeded generator, then moved, so a GPU and
the interpreter compare the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SHAPE = dict(batch=2, tokens=100, key_heads=2, value_heads=4, head_dim=64, conv_kernel=4)
# The fused recurrent rule is the decode kernel (one token a call in the model, one per tree depth in
# eval): its first 16 tokens of the same inputs carry the state through enough steps, at a sixth of
# the interpreter's cost of 100 (15 s on one core).
RECURRENT_TOKENS = 16


@dataclass
class OpPair:
    op: str                                  # the op name kernel provenance records (DESIGN 6)
    kernel: dict[str, torch.Tensor]          # fla's outputs, by name
    reference: dict[str, torch.Tensor]       # transformers' torch function's outputs, same names

    def max_abs_diff(self) -> dict[str, float]:
        return {name: float((self.kernel[name].float() - ref.float()).abs().max()) for name, ref in self.reference.items()}


def torch_reference(name: str):
    """transformers' torch implementation of a qwen3_5 op, whatever the module binds it to."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from pipeline.target_model.internals.versions import torch_function

    return torch_function(getattr(modeling_qwen3_5, name))


def _gated_delta_inputs(shape: dict, device, dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    b, t, h, hv, d = shape["batch"], shape["tokens"], shape["key_heads"], shape["value_heads"], shape["head_dim"]
    made = {"query": torch.randn(b, t, h, d, generator=g), "key": torch.randn(b, t, h, d, generator=g),
            "value": torch.randn(b, t, hv, d, generator=g),
            # as the layer makes them: g = -exp(A_log) * softplus(.) < 0 (a log decay), beta = sigmoid(.);
            # decays mild enough (about 0.97 a token) that the initial state still shapes the last
            # token's output and state (at 0.5 a token it is gone after 100 tokens, and a kernel
            # that dropped it would pass)
            "g": -0.05 * torch.nn.functional.softplus(torch.randn(b, t, hv, generator=g)),
            "beta": torch.rand(b, t, hv, generator=g),
            # a state a prefill leaves behind: non-zero, of the size the rule's outputs keep
            "initial_state": torch.randn(b, hv, d, d, generator=g) * 0.5}
    return {k: v.to(device=device, dtype=torch.float32 if k in ("g", "initial_state") else dtype) for k, v in made.items()}


def gated_delta_rule_pairs(device, dtype=torch.float32, shape: dict | None = None, seed: int = 0,
                           kernel_from_zero: bool = False) -> list[OpPair]:
    """The chunked and the fused recurrent rule, with an initial state and the final state, as
    the layer calls them (q/k l2-normalised inside the kernel). `kernel_from_zero`: the kernel
    is given no initial state (the reference still is): a pair that must differ."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    inputs = _gated_delta_inputs(shape or SHAPE, device, dtype, seed)
    pairs = []
    for op, kernel, reference in (
            ("chunk_gated_delta_rule", chunk_gated_delta_rule, torch_reference("torch_chunk_gated_delta_rule")),
            ("fused_recurrent_gated_delta_rule", fused_recurrent_gated_delta_rule,
             torch_reference("torch_recurrent_gated_delta_rule"))):
        n = RECURRENT_TOKENS if op == "fused_recurrent_gated_delta_rule" else None
        q, k, v, g, beta = (inputs[name][:, :n] for name in ("query", "key", "value", "g", "beta"))
        outputs = []
        for fn in (kernel, reference):
            start = None if kernel_from_zero and fn is kernel else inputs["initial_state"].clone()
            out, state = fn(q, k, v, g=g, beta=beta, initial_state=start, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
            outputs.append({"output": out, "final_state": state})
        pairs.append(OpPair(op, *outputs))
    return pairs


def conv_pairs(device, dtype=torch.float32, shape: dict | None = None, seed: int = 0) -> list[OpPair]:
    """fla's Triton causal conv (prefill, then a one-token update of the conv state) against the
    torch `causal_conv1d_fn` / `causal_conv1d_update`, with the layer's SiLU. transformers binds
    the conv to the causal-conv1d package, not fla; fla's conv is what fla's own layers use, the
    other Triton implementation of the same op. Layouts differ: torch takes [B, D, T], fla [B, T, D]."""
    from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update

    s = shape or SHAPE
    channels = 2 * s["key_heads"] * s["head_dim"] + s["value_heads"] * s["head_dim"]   # q, k, v: the layer's conv_dim
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s["batch"], s["tokens"], channels, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(channels, s["conv_kernel"], generator=g) * 0.5).to(device=device, dtype=dtype)
    step = torch.randn(s["batch"], 1, channels, generator=g).to(device=device, dtype=dtype)

    kernel_out, _ = causal_conv1d(x, weight=weight, activation="silu")
    reference_out = torch_reference("causal_conv1d_fn")(x.transpose(1, 2), weight, None, activation="silu").transpose(1, 2)
    pairs = [OpPair("causal_conv1d_fn", {"output": kernel_out}, {"output": reference_out})]

    # The conv state after the prefill: its last `conv_kernel` inputs (channels first, as both keep it).
    state = x[:, -s["conv_kernel"]:].transpose(1, 2).contiguous()
    kernel_state, reference_state = state.clone(), state.clone()
    kernel_step, _ = causal_conv1d_update(step, kernel_state, weight=weight, activation="silu")
    reference_step = torch_reference("causal_conv1d_update")(step.transpose(1, 2), reference_state, weight, None, "silu")
    pairs.append(OpPair("causal_conv1d_update", {"output": kernel_step, "conv_state": kernel_state},
                        {"output": reference_step.transpose(1, 2), "conv_state": reference_state}))
    return pairs


def all_pairs(device, dtype=torch.float32, shape: dict | None = None) -> list[OpPair]:
    return gated_delta_rule_pairs(device, dtype, shape) + conv_pairs(device, dtype, shape)
