"""Every transformers API beyond `from_pretrained` + a plain forward that the project relies on,
checked one by one so that an upgrade that moves one fails here, loudly, naming the internal and
its user, instead of somewhere deep in extract or eval. All of them are used through the
package pipeline/target_model/internals/ (the only modules that touch them; the first test checks
that no other module imports transformers' modeling or cache internals), whose versions.py holds
one adapter per change between the supported releases: each test here passes on every release of
pyproject's range (CI runs this file on the oldest and the newest)."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers


def fail(internal: str, user: str, found) -> str:
    return (f"transformers {transformers.__version__}: {internal} moved or changed (found: {found}); "
            f"{user} depends on it")


# The package that owns every use of transformers' internals (split by job: loading, kernels and
# the cache's state; the tree-verification patches; the adapters between releases).
INTERNALS_PACKAGE = "pipeline/target_model/internals/"


def test_only_the_internals_module_imports_transformers_internals():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    internal = re.compile(r"transformers\.(models\.\w+\.(modeling|tokenization)_|cache_utils|distributed|masking_utils)")
    users = sorted(str(p.relative_to(root)) for folder in ("pipeline", "stages") for p in (root / folder).rglob("*.py")
                   if internal.search(p.read_text()) and not p.relative_to(root).as_posix().startswith(INTERNALS_PACKAGE))
    users += ["cli.py"] if internal.search((root / "cli.py").read_text()) else []
    assert not users, f"transformers internals used outside {INTERNALS_PACKAGE}: {users}"


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
        "pipeline/target_model/internals/tree.py (tree_rules)", f"{len(verified.states)} of {linear} layers recorded")
    plain = live.run([20, 40], LiveTarget.copy(state), len(prompt), with_hidden=False).logits
    assert torch.allclose(verified.step.logits[[0, 2]], plain, rtol=1e-4, atol=1e-4), fail(
        "causal_conv1d_fn through the module globals / attention_mask as a dict per layer kind",
        "pipeline/target_model/internals/tree.py (tree_rules), internals/__init__.py (attention_masks)",
        float((verified.step.logits[[0, 2]] - plain).abs().max()))
    for layer in state.layers:
        names = ("conv_states", "recurrent_states", "conv_kernel_size", "record_past") \
            if internals.is_linear_attention(layer) else ("keys", "values")
        missing = [n for n in names if not hasattr(layer, n)]
        assert not missing and hasattr(state, "crop") and hasattr(state, "activate_past_recording"), fail(
            "cache layer attributes", "pipeline/target_model/internals/__init__.py (keep_prefix), tree.py (keep_path)", missing)


def test_the_forward_continues_the_cache_it_is_given(target):
    """live.py passes the cache under the keyword this release names (`cache=` from 5.24,
    `past_key_values=` before; an unknown keyword is silently dropped there) and reads it back off
    the output: a pass continuing the returned cache must give the logits a plain forward of the
    whole sequence gives."""
    from pipeline.target_model.internals import forward_with_cache

    whole = target(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), use_cache=False).logits[0, 3:]
    _, cache = forward_with_cache(target, None, input_ids=torch.tensor([[5, 6, 7]]), use_cache=True)
    assert cache is not None and hasattr(cache, "layers"), fail(
        "the forward's cache keyword / the output's cache", "pipeline/target_model/internals/versions.py "
        "(forward_with_cache)", type(cache))
    out, _ = forward_with_cache(target, cache, input_ids=torch.tensor([[8, 9]]), position_ids=torch.tensor([[3, 4]]),
                                use_cache=True)
    assert torch.allclose(out.logits[0], whole, rtol=1e-4, atol=1e-4), fail(
        "the forward's cache keyword (the cache was not continued)",
        "pipeline/target_model/internals/versions.py (forward_with_cache)", float((out.logits[0] - whole).abs().max()))


def test_loading_without_hub_kernels_is_accepted(embedded):
    """5.25 kernelizes at load unless told not to (and refuses to load without the `kernels`
    package); every release of the range takes `use_kernels=False`, which the project passes."""
    from transformers import AutoModelForCausalLM

    from pipeline.target_model.internals import LOAD_WITHOUT_HUB_KERNELS

    model = AutoModelForCausalLM.from_pretrained(embedded.TARGET_DIR, local_files_only=True, **LOAD_WITHOUT_HUB_KERNELS)
    assert not getattr(model, "use_kernels", False), fail(
        "from_pretrained(use_kernels=False)", "pipeline/target_model/loading.py", model.use_kernels)


def test_cache_layers_hold_batch_one_tensors_that_repeat_into_rows(target):
    """LiveTarget verifies a DDTree's paths as rows of one batch by repeating a batch-1 cache
    (`repeat_state` / `select_row` walk `cache.layers` and their tensor attributes): each row must then
    continue the prompt exactly as a batch-1 run does."""
    from pipeline.target_model.live import LiveTarget

    live = LiveTarget(target, [1, 3, 5])
    state = live.run([5, 6, 7, 8], None, 0).state
    assert hasattr(state, "layers") and len(state.layers) == target.config.num_hidden_layers, fail(
        "the cache's per-layer list `.layers`", "pipeline/target_model/internals/__init__.py (repeat_state)", type(state))
    tensors = [v for layer in state.layers for v in vars(layer).values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    assert tensors and all(t.shape[0] == 1 for t in tensors), fail(
        "cache layer tensors with the batch first", "pipeline/target_model/internals/__init__.py (repeat_state)",
        [tuple(t.shape) for t in tensors][:4])
    rows = torch.tensor([[9, 10], [11, 12], [13, 14]])
    batched = live.verify_rows(rows, state, 4).step.logits
    for r in range(3):
        alone = live.run(rows[r].tolist(), LiveTarget.copy(state), 4, with_hidden=False).logits
        torch.testing.assert_close(batched[r], alone, rtol=1e-4, atol=1e-4)


def test_distributed_config_takes_the_tensor_parallel_layout():
    """tp_size and tp_plan on every release; data-parallel replicas (dp_replicate_size) from 5.23,
    before which the adapter refuses tp with dp > 1 in one line instead of building a wrong mesh."""
    from transformers.distributed import DistributedConfig

    from pipeline.errors import PipelineError
    from pipeline.target_model.internals import distributed_config

    params = set(inspect.signature(DistributedConfig).parameters)
    missing = {"tp_size", "tp_plan"} - params
    assert not missing, fail("DistributedConfig(tp_size, tp_plan)",
                             "pipeline/target_model/internals/versions.py (distributed_config)", sorted(params))
    assert distributed_config(2, 1, "auto").tp_size == 2
    if "dp_replicate_size" in params:
        assert distributed_config(2, 3, "auto").dp_replicate_size == 3
    else:
        with pytest.raises(PipelineError, match="needs transformers>=5.23"):
            distributed_config(2, 3, "auto")


def test_linear_attention_ops_are_where_provenance_looks():
    """Kernel provenance reads the Gated DeltaNet ops off the qwen3_5 modeling module by name."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from pipeline.target_model.internals import LINEAR_ATTENTION_OPS, bound_kernels

    present = [name for name in LINEAR_ATTENTION_OPS if hasattr(modeling_qwen3_5, name)]
    assert "torch_chunk_gated_delta_rule" in present and "torch_recurrent_gated_delta_rule" in present, fail(
        "modeling_qwen3_5's gated delta rule functions", "pipeline/target_model/internals/__init__.py (bound_kernels)", present)
    kinds = {op: v["kind"] for op, v in bound_kernels(modeling_qwen3_5).items()}
    assert "unknown" not in kinds.values(), fail(
        "the kernel wrapper's `implementation` closure", "pipeline/target_model/internals/__init__.py (bound_kernels)", kinds)


def test_the_embedded_tokenizer_builder_finds_qwen35s_pretokenizer():
    module = pytest.importorskip("transformers.models.qwen3_5.tokenization_qwen3_5")
    assert hasattr(module, "PRETOKENIZE_REGEX") and hasattr(module, "Qwen3_5Tokenizer"), fail(
        "tokenization_qwen3_5.PRETOKENIZE_REGEX / Qwen3_5Tokenizer", "pipeline/target_model/internals/__init__.py (qwen3_5_pretokenizer)",
        [n for n in dir(module) if not n.startswith("_")][:8])


def test_hidden_states_are_embedding_then_each_decoder_layer(target):
    """Taps index `hidden_states[i + 1]` (DESIGN 3.1): one entry per decoder layer after the embedding."""
    out = target(input_ids=torch.tensor([[5, 6, 7]]), output_hidden_states=True)
    assert len(out.hidden_states) == target.config.num_hidden_layers + 1, fail(
        "output_hidden_states' layout (embedding + one per layer)", "pipeline/target_model/capture.py, pipeline/target_model/taps.py",
        len(out.hidden_states))


def test_a_tensor_parallel_style_keeps_attention_whole():
    """Tensor-parallel extract replicates self_attn when the KV heads do not divide by tp: "replicate"
    from 5.21, "replicated_with_grad_allreduce" before (the same at inference)."""
    from pipeline.target_model.internals import replicated_style

    assert replicated_style() in ("replicate", "replicated_with_grad_allreduce"), fail(
        "a tensor-parallel style that keeps a layer whole", "pipeline/target_model/loading.py", replicated_style())
