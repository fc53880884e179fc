"""Every transformers API beyond `from_pretrained` + a plain forward that the project relies on,
checked one by one so that an upgrade that moves one fails here, loudly, naming the internal and
the module that uses it, instead of somewhere deep in extract or eval."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers


def fail(internal: str, user: str, found) -> str:
    return (f"transformers {transformers.__version__}: {internal} moved or changed (found: {found}); "
            f"{user} depends on it")


def test_forward_takes_cache_and_returns_it(target):
    out = target(input_ids=torch.tensor([[5, 6, 7]]), cache=None, use_cache=True)
    assert getattr(out, "cache", None) is not None, fail(
        "the forward's `cache=` keyword / `out.cache`", "pipeline/speculative/live_target.py (LiveTarget.run)",
        sorted(k for k in out.keys()))


def test_cache_layers_hold_batch_one_tensors_that_repeat_into_rows(target):
    """LiveTarget verifies a DDTree's paths as rows of one batch by repeating a batch-1 cache
    (`_repeat_state` / `_select_row` walk `cache.layers` and their tensor attributes): each row must then
    continue the prompt exactly as a batch-1 run does."""
    from pipeline.speculative.live_target import LiveTarget

    live = LiveTarget(target, [1, 3, 5])
    state = live.run([5, 6, 7, 8], None, 0).state
    assert hasattr(state, "layers") and len(state.layers) == target.config.num_hidden_layers, fail(
        "the cache's per-layer list `.layers`", "pipeline/speculative/live_target.py (_repeat_state)", type(state))
    tensors = [v for layer in state.layers for v in vars(layer).values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    assert tensors and all(t.shape[0] == 1 for t in tensors), fail(
        "cache layer tensors with the batch first", "pipeline/speculative/live_target.py (_repeat_state)",
        [tuple(t.shape) for t in tensors][:4])
    rows = torch.tensor([[9, 10], [11, 12], [13, 14]])
    batched = live.verify_rows(rows, state, 4).step.logits
    for r in range(3):
        alone = live.run(rows[r].tolist(), LiveTarget.copy(state), 4, with_hidden=False).logits
        torch.testing.assert_close(batched[r], alone, rtol=1e-4, atol=1e-4)


def test_distributed_config_takes_the_tensor_parallel_layout():
    from transformers.distributed import DistributedConfig

    params = inspect.signature(DistributedConfig).parameters
    missing = {"tp_size", "dp_replicate_size", "tp_plan"} - set(params)
    assert not missing, fail("DistributedConfig(tp_size, dp_replicate_size, tp_plan)",
                             "pipeline/tensor_parallel.py (tp_load_kwargs)", sorted(params))


def test_linear_attention_ops_are_where_provenance_looks():
    """Kernel provenance reads the Gated DeltaNet ops off the qwen3_5 modeling module by name."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from pipeline.provenance import LINEAR_ATTENTION_OPS, bound_kernels

    present = [name for name in LINEAR_ATTENTION_OPS if hasattr(modeling_qwen3_5, name)]
    assert "torch_chunk_gated_delta_rule" in present and "torch_recurrent_gated_delta_rule" in present, fail(
        "modeling_qwen3_5's gated delta rule functions", "pipeline/provenance.py (bound_kernels)", present)
    kinds = {op: v["kind"] for op, v in bound_kernels(modeling_qwen3_5).items()}
    assert "unknown" not in kinds.values(), fail(
        "the kernel wrapper's `implementation` closure", "pipeline/provenance.py (bound_kernels)", kinds)


def test_the_embedded_tokenizer_builder_finds_qwen35s_pretokenizer():
    module = pytest.importorskip("transformers.models.qwen3_5.tokenization_qwen3_5")
    assert hasattr(module, "PRETOKENIZE_REGEX") and hasattr(module, "Qwen3_5Tokenizer"), fail(
        "tokenization_qwen3_5.PRETOKENIZE_REGEX / Qwen3_5Tokenizer", "pipeline/toy/tokenizer.py",
        [n for n in dir(module) if not n.startswith("_")][:8])


def test_hidden_states_are_embedding_then_each_decoder_layer(target):
    """Taps index `hidden_states[i + 1]` (DESIGN 3.1): one entry per decoder layer after the embedding."""
    out = target(input_ids=torch.tensor([[5, 6, 7]]), output_hidden_states=True)
    assert len(out.hidden_states) == target.config.num_hidden_layers + 1, fail(
        "output_hidden_states' layout (embedding + one per layer)", "pipeline/capture.py, pipeline/taps.py",
        len(out.hidden_states))
