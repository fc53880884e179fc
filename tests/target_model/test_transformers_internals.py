"""Every transformers API beyond `from_pretrained` + a plain forward that the project relies on,
checked one by one so that an upgrade that moves one fails here, loudly, naming the internal and
its user, instead of somewhere deep in extract or eval. All of them are used through
pipeline/target_model/internals.py and tree_internals.py (the only modules that touch them; the first test checks
that no other module imports transformers' modeling or cache internals)."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers


def fail(internal: str, user: str, found) -> str:
    return (f"transformers {transformers.__version__}: {internal} moved or changed (found: {found}); "
            f"{user} depends on it")


# The modules that own every use of transformers' internals (split by job: loading, kernels and
# the cache's state; the tree-verification patches).
INTERNALS_MODULES = ("pipeline/target_model/internals.py", "pipeline/target_model/tree_internals.py")


def test_only_the_internals_module_imports_transformers_internals():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    internal = re.compile(r"transformers\.(models\.\w+\.(modeling|tokenization)_|cache_utils|distributed|masking_utils)")
    users = sorted(str(p.relative_to(root)) for folder in ("pipeline", "stages") for p in (root / folder).rglob("*.py")
                   if internal.search(p.read_text()) and p.relative_to(root).as_posix() not in INTERNALS_MODULES)
    users += ["cli.py"] if internal.search((root / "cli.py").read_text()) else []
    assert not users, f"transformers internals used outside {' and '.join(INTERNALS_MODULES)}: {users}"


def test_the_tree_patches_and_the_per_kind_mask_reach_the_layers(target):
    """Tree verification swaps modeling_qwen3_5's `causal_conv1d_fn` / `torch_chunk_gated_delta_rule`
    (the layers must call them through the module's globals) and passes `attention_mask` as a
    dict per layer kind. A root with two children: the second child must continue the root
    alone (its conv window and recurrent state skip its sibling; the attention mask hides the
    sibling), as a plain run of [root, second child] does."""
    from pipeline.target_model import internals
    from pipeline.target_model.live import LiveTarget

    live = LiveTarget(target, [1, 3, 5])
    prompt = [5, 6, 7, 8, 9]
    state = live.run(prompt, None, 0).state
    verified = live.verify_tree([20, 30, 40], [-1, 0, 0], LiveTarget.copy(state), len(prompt))
    linear = sum(internals.is_linear_attention(layer) for layer in state.layers)
    assert len(verified.states) == linear, fail(
        "the Gated DeltaNet forward calling torch_chunk_gated_delta_rule through the module globals",
        "pipeline/target_model/tree_internals.py (tree_rules)", f"{len(verified.states)} of {linear} layers recorded")
    plain = live.run([20, 40], LiveTarget.copy(state), len(prompt), with_hidden=False).logits
    assert torch.allclose(verified.step.logits[[0, 2]], plain, rtol=1e-4, atol=1e-4), fail(
        "causal_conv1d_fn through the module globals / attention_mask as a dict per layer kind",
        "pipeline/target_model/tree_internals.py (tree_rules), internals.py (attention_masks)",
        float((verified.step.logits[[0, 2]] - plain).abs().max()))
    for layer in state.layers:
        names = ("conv_states", "recurrent_states", "conv_kernel_size", "record_past") \
            if internals.is_linear_attention(layer) else ("keys", "values")
        missing = [n for n in names if not hasattr(layer, n)]
        assert not missing and hasattr(state, "crop") and hasattr(state, "activate_past_recording"), fail(
            "cache layer attributes", "pipeline/target_model/internals.py (keep_prefix), tree_internals.py (keep_path)", missing)


def test_forward_takes_cache_and_returns_it(target):
    out = target(input_ids=torch.tensor([[5, 6, 7]]), cache=None, use_cache=True)
    assert getattr(out, "cache", None) is not None, fail(
        "the forward's `cache=` keyword / `out.cache`", "pipeline/target_model/live.py (LiveTarget.run)",
        sorted(k for k in out.keys()))


def test_cache_layers_hold_batch_one_tensors_that_repeat_into_rows(target):
    """LiveTarget verifies a DDTree's paths as rows of one batch by repeating a batch-1 cache
    (`repeat_state` / `select_row` walk `cache.layers` and their tensor attributes): each row must then
    continue the prompt exactly as a batch-1 run does."""
    from pipeline.target_model.live import LiveTarget

    live = LiveTarget(target, [1, 3, 5])
    state = live.run([5, 6, 7, 8], None, 0).state
    assert hasattr(state, "layers") and len(state.layers) == target.config.num_hidden_layers, fail(
        "the cache's per-layer list `.layers`", "pipeline/target_model/internals.py (repeat_state)", type(state))
    tensors = [v for layer in state.layers for v in vars(layer).values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    assert tensors and all(t.shape[0] == 1 for t in tensors), fail(
        "cache layer tensors with the batch first", "pipeline/target_model/internals.py (repeat_state)",
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
                             "pipeline/target_model/internals.py (distributed_config)", sorted(params))


def test_linear_attention_ops_are_where_provenance_looks():
    """Kernel provenance reads the Gated DeltaNet ops off the qwen3_5 modeling module by name."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from pipeline.target_model.internals import LINEAR_ATTENTION_OPS, bound_kernels

    present = [name for name in LINEAR_ATTENTION_OPS if hasattr(modeling_qwen3_5, name)]
    assert "torch_chunk_gated_delta_rule" in present and "torch_recurrent_gated_delta_rule" in present, fail(
        "modeling_qwen3_5's gated delta rule functions", "pipeline/target_model/internals.py (bound_kernels)", present)
    kinds = {op: v["kind"] for op, v in bound_kernels(modeling_qwen3_5).items()}
    assert "unknown" not in kinds.values(), fail(
        "the kernel wrapper's `implementation` closure", "pipeline/target_model/internals.py (bound_kernels)", kinds)


def test_the_embedded_tokenizer_builder_finds_qwen35s_pretokenizer():
    module = pytest.importorskip("transformers.models.qwen3_5.tokenization_qwen3_5")
    assert hasattr(module, "PRETOKENIZE_REGEX") and hasattr(module, "Qwen3_5Tokenizer"), fail(
        "tokenization_qwen3_5.PRETOKENIZE_REGEX / Qwen3_5Tokenizer", "pipeline/target_model/internals.py (qwen3_5_pretokenizer)",
        [n for n in dir(module) if not n.startswith("_")][:8])


def test_hidden_states_are_embedding_then_each_decoder_layer(target):
    """Taps index `hidden_states[i + 1]` (DESIGN 3.1): one entry per decoder layer after the embedding."""
    out = target(input_ids=torch.tensor([[5, 6, 7]]), output_hidden_states=True)
    assert len(out.hidden_states) == target.config.num_hidden_layers + 1, fail(
        "output_hidden_states' layout (embedding + one per layer)", "pipeline/target_model/capture.py, pipeline/target_model/taps.py",
        len(out.hidden_states))
