"""fla's Triton kernels, op by op, against transformers' torch functions for qwen3_5 (the path the
main suite runs): the chunked and the fused recurrent gated delta rule with an initial state and
their final states, and fla's causal conv (prefill and one-token update), fp32 under Triton's
interpreter. Equal within fp32 rounding: the kernels sum in another order, nothing more."""

import pytest
import torch

from harness.kernel_ops import RECURRENT_TOKENS, SHAPE, conv_pairs, gated_delta_rule_pairs

# fp32 rounding of sums over a 64-token chunk and a 64-wide head of O(1) values: a few 1e-7
# measured (BENCHMARKS: Kernels under Triton's interpreter); a wrong state, gate or scale is O(0.1).
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def rule_pairs():
    return {p.op: p for p in gated_delta_rule_pairs("cpu")}


@pytest.fixture(scope="module")
def conv():
    return {p.op: p for p in conv_pairs("cpu")}


def _assert_close(pair):
    for name, reference in pair.reference.items():
        kernel = pair.kernel[name]
        assert kernel.shape == reference.shape and kernel.dtype == torch.float32, (pair.op, name)
        scale = max(1.0, float(reference.abs().max()))
        diff = float((kernel - reference).abs().max())
        assert diff <= TOLERANCE * scale, f"{pair.op} {name}: max abs diff {diff:.3g}"


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_gated_delta_rule_matches_torch(rule_pairs, op):
    pair = rule_pairs[op]
    _assert_close(pair)
    b, hv, d = SHAPE["batch"], SHAPE["value_heads"], SHAPE["head_dim"]
    t = RECURRENT_TOKENS if op == "fused_recurrent_gated_delta_rule" else SHAPE["tokens"]
    assert pair.kernel["output"].shape == (b, t, hv, d) and pair.kernel["final_state"].shape == (b, hv, d, d)


def test_the_initial_state_counts():
    """The comparison would pass vacuously if the inputs made the initial state irrelevant (a fast
    decay forgets it): the kernel from a zero state ends far from the reference's output and state."""
    for pair in gated_delta_rule_pairs("cpu", kernel_from_zero=True):
        for name in ("output", "final_state"):
            assert float((pair.kernel[name] - pair.reference[name]).abs().max()) > 1000 * TOLERANCE, (pair.op, name)


@pytest.mark.parametrize("op", ["causal_conv1d_fn", "causal_conv1d_update"])
def test_causal_conv_matches_torch(conv, op):
    _assert_close(conv[op])
