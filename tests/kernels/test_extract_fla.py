"""`pipeline extract` of the embedded target with fla bound (Triton's interpreter, fp32): the cache
records fla per op, as observed (DESIGN 6); its taps and labels are the torch path's within fp32
rounding; verify-cache passes it; and a cache that mixes an fla shard with a torch shard is
refused by train without --allow-mixed-provenance and reported by verify-cache.

The torch path is extracted in the same process with the ops bound as transformers binds them
where fla is absent (harness/kernel_binding.py). Short conversations keep the interpreter's
forwards (about 0.08 s a token on one core) to seconds."""

import json
import shutil

import numpy as np
import pytest
import torch

from harness.kernel_binding import torch_bound
from harness.runs import cli_here, write_rows
from pipeline.cache.reader import CacheReader
from pipeline.cache.schema import HIDDEN, TARGET_TOPK_IDS
from pipeline.config import ExtractConfig
from stages.extract.run import run_extract

ROWS = 4        # the shortest training conversations (33-35 tokens), two per shard
SHARDS = 2


@pytest.fixture(scope="module")
def rows(train_rows, tokenizer):
    def length(row):
        text = tokenizer.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=False,
                                             **row.get("chat_template_kwargs", {}))
        return len(tokenizer(text)["input_ids"])
    return sorted(train_rows[:200], key=length)[:ROWS]


def _extract(root, rows, shards=None):
    data = write_rows(root / "convs.jsonl", rows)
    run_extract(ExtractConfig(cache=str(root / "cache"), data=[str(data)], num_shards=SHARDS), shards, progress=False)
    return root / "cache"


@pytest.fixture(scope="module")
def fla_cache(tmp_path_factory, rows):
    return _extract(tmp_path_factory.mktemp("fla"), rows)


@pytest.fixture(scope="module")
def torch_cache(tmp_path_factory, rows):
    with torch_bound():
        return _extract(tmp_path_factory.mktemp("torch"), rows)


def test_provenance_says_fla_per_op(fla_cache, torch_cache):
    for name, record in CacheReader(fla_cache).manifest.shards.items():
        ops = record.kernels["ops"]
        # prefill runs the chunked rule; the conv is bound to the causal-conv1d package, not fla,
        # so without it the torch conv runs beside fla's rule, and the record says so
        assert ops["chunk_gated_delta_rule"]["kind"] == "fla" and ops["chunk_gated_delta_rule"]["calls"] > 0, name
        assert ops["fused_recurrent_gated_delta_rule"]["kind"] == "fla", name
        assert ops["causal_conv1d_fn"]["kind"] == "torch" and ops["causal_conv1d_fn"]["calls"] > 0, name
        assert record.kernel_path == "fla+torch", name
        assert record.environment["flash_linear_attention"] == "0.6.0" and record.environment["triton"] == "3.7.1", name
    for name, record in CacheReader(torch_cache).manifest.shards.items():
        assert {op: info["kind"] for op, info in record.kernels["ops"].items()} == {
            "chunk_gated_delta_rule": "torch", "fused_recurrent_gated_delta_rule": "torch",
            "causal_conv1d_fn": "torch", "causal_conv1d_update": "torch"}, name
        assert record.kernel_path == "torch", name


def test_taps_and_labels_equal_the_torch_path(fla_cache, torch_cache):
    fla, reference = CacheReader(fla_cache), CacheReader(torch_cache)
    assert fla.sample_ids() == reference.sample_ids() and len(fla.sample_ids()) == ROWS
    worst, differing, values = 0.0, 0, 0
    for sid in fla.sample_ids():
        a, b = fla.find(sid).sample(sid), reference.find(sid).sample(sid)
        for name in a:
            if name == HIDDEN:
                continue
            if np.issubdtype(a[name].dtype, np.floating):   # stored logits: fp32 rounding apart
                np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=1e-4, err_msg=name)
            elif name == TARGET_TOPK_IDS:   # near-ties may swap neighbours; the best one may not
                assert np.array_equal(a[name][:, 0], b[name][:, 0]), name
            else:
                assert np.array_equal(a[name], b[name]), (sid, name)
        # bf16 taps of fp32 states that agree to ~1e-5: most round to the same bf16, the rest one
        # bf16 step (2^-8 relative) apart
        ha, hb = a[HIDDEN].float(), b[HIDDEN].float()
        step = hb.abs().clamp_min(2 ** -20) * 2 ** -7
        assert bool(((ha - hb).abs() <= step).all()), sid
        worst = max(worst, float((ha - hb).abs().max()))
        differing += int((ha != hb).sum())
        values += ha.numel()
    # measured: 9 of 51,456 (0.02%); a kernel that were wrong would move nearly all of them
    assert differing <= 0.01 * values, f"{differing} of {values} bf16 tap values differ (worst {worst:.3g})"


def test_verify_cache_passes_the_fla_cache(fla_cache):
    result = cli_here("verify-cache", str(fla_cache), "--json", "--recompute", "2")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert {c["check"]: c["status"] for c in report["checks"]}["recompute"] == "pass"
    recompute = next(c for c in report["checks"] if c["check"] == "recompute")["evidence"]
    assert recompute["kernel_path_now"] == "fla+torch" and recompute["kernel_path_recorded"] == ["fla+torch"]


@pytest.fixture(scope="module")
def mixed(fla_cache, rows, tmp_path_factory):
    """Shard 1 extracted again where fla is absent, as a user mends a cache on another machine."""
    root = tmp_path_factory.mktemp("mixed")
    shutil.copytree(fla_cache, root / "cache")
    shutil.rmtree(root / "cache" / "shard-00001")
    with torch_bound():
        _extract(root, rows, shards="1")
    return root / "cache"


def test_mixed_cache_train_refuses_without_the_flag(mixed, tmp_path):
    paths = {name: r.kernel_path for name, r in CacheReader(mixed).manifest.shards.items()}
    assert paths == {"shard-00000": "fla+torch", "shard-00001": "torch"}
    refused = cli_here("train", "--cache", str(mixed), "--out", str(tmp_path / "run"), "--max-steps", "2")
    assert refused.returncode == 1
    assert "mixed kernel provenance" in refused.stderr and "--allow-mixed-provenance" in refused.stderr
    allowed = cli_here("train", "--cache", str(mixed), "--out", str(tmp_path / "run"), "--max-steps", "2",
                       "--batch-sequences", "2", "--allow-mixed-provenance")   # 4 samples: a batch of 2
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert "mixed kernel provenance" in allowed.stderr


def test_mixed_cache_verify_reports_it(mixed):
    result = cli_here("verify-cache", str(mixed), "--json")
    assert result.returncode == 1
    provenance = next(c for c in json.loads(result.stdout)["checks"] if c["check"] == "provenance")
    assert provenance["status"] == "fail" and "MIXED" in provenance["summary"]
    assert provenance["evidence"]["kernel_paths"] == {"fla+torch": 1, "torch": 1}


def test_provenance_says_torch_where_transformers_runs_torch():
    """transformers 5.25 on keeps fla bound but runs its torch function for inputs on a device fla
    is not listed for (the CPU, outside this tier's patch (c)): provenance must then say torch,
    and fla where the device is listed. The op is bound by transformers' own decorator, around a
    torch function that counts its calls, so what ran is observed, not inferred."""
    import functools
    import types

    from transformers.integrations import hub_kernels, use_kernel_func_from_hub_with_fallback

    from harness.kernel_ops import SHAPE, _gated_delta_inputs, torch_reference
    from pipeline.target_model.internals import bound_kernels

    table = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", None)
    if table is None:
        pytest.skip("this transformers runs the bound package on every device (before 5.25)")
    reference, calls = torch_reference("torch_chunk_gated_delta_rule"), []

    @functools.wraps(reference)
    def counted(*args, **kwargs):
        calls.append(1)
        return reference(*args, **kwargs)

    listed = table["fla"]
    table["fla"] = tuple(d for d in listed if d != "cpu")   # as transformers ships it
    try:
        wrapper = use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")(counted)
    finally:
        table["fla"] = listed
    module = types.SimpleNamespace(torch_chunk_gated_delta_rule=wrapper)
    assert bound_kernels(module, "cpu")["chunk_gated_delta_rule"]["kind"] == "torch"
    assert bound_kernels(module, "cuda")["chunk_gated_delta_rule"]["kind"] == "fla"
    x = _gated_delta_inputs(SHAPE, "cpu", torch.float32, 0)
    wrapper(x["query"], x["key"], x["value"], g=x["g"], beta=x["beta"], use_qk_l2norm_in_kernel=True)
    assert calls == [1]   # the torch function ran on the CPU, as provenance says
