"""verify-cache proves every sample (DESIGN 10): a fault confined to ONE sample of one shard,
re-signed in the manifest as a buggy extractor would have signed what it wrote, is caught at
default options and named with its sample id. Plus completeness and unknown kernel provenance."""

import json
import shutil

import numpy as np
import pytest
import zarr

from harness.caches import manifest_json, resign, uncommit
from harness.runs import cli, cli_here, write_rows
from pipeline.cache.reader import CacheReader
from pipeline.config import Data, ExtractConfig, Job, Schedule, TrainConfig
from pipeline.errors import PipelineError
from stages.extract.run import run_extract
from stages.verify_cache.options import VerifyOptions
from stages.verify_cache.run import run_verify

IM_START, IM_END = 497, 498   # the shipped tokenizer's ids (tests/verify/test_verify.py checks them)
VICTIM_SHARD, VICTIM_ROW = "shard-00001", 3


@pytest.fixture(scope="module")
def caches(tmp_path_factory, train_rows):
    """A good cache (4 shards) and one tapped a layer early (for the wrong-layer fault)."""
    root = tmp_path_factory.mktemp("samples")
    data = write_rows(root / "convs.jsonl", train_rows[:32])
    good, early = root / "good", root / "early"
    run_extract(ExtractConfig(cache=str(good), data=[str(data)], num_shards=4), None, progress=False)
    run_extract(ExtractConfig(cache=str(early), data=[str(data)], num_shards=4, layers=[0, 2, 4]), None, progress=False)
    return good, early


def victim(cache):
    shard = CacheReader(cache).shard(VICTIM_SHARD)
    a, b = int(shard.offsets[VICTIM_ROW]), int(shard.offsets[VICTIM_ROW + 1])
    return int(shard.sample_ids[VICTIM_ROW]), a, b


def rewrite(cache, array, fn):
    """Change one array of the victim sample only, then re-sign the shard (its digests)."""
    _, a, b = victim(cache)
    arr = zarr.open_array(str(cache / VICTIM_SHARD / array), mode="r+")
    ids = zarr.open_array(str(cache / VICTIM_SHARD / "input_ids"), mode="r")[a:b]
    arr[a:b] = fn(arr[a:b], ids)
    resign(cache, VICTIM_SHARD)


def header_supervised(mask, ids):
    out = mask.copy()
    starts = np.flatnonzero((mask == 1) & (np.concatenate([[0], mask[:-1]]) == 0))
    out[starts[0] - 3:starts[0]] = 1
    return out


def user_supervised(mask, ids):
    out = mask.copy()
    for start in np.flatnonzero(ids == IM_START):
        end = start + int(np.argmax(ids[start:] == IM_END))
        if not mask[start:end + 1].any():  # a turn with nothing supervised: system or user
            out[start + 3:end + 1] = 1
            return out
    raise AssertionError("the sample has no system or user turn")


def end_unsupervised(mask, ids):
    out = mask.copy()
    out[(ids == IM_END) & (mask == 1)] = 0
    return out


def nan_in_one_tap(hidden, ids):
    out = hidden.copy()
    out[len(out) // 2, 1, 0] = 0x7FC0  # bfloat16 NaN bit pattern
    return out


def from_early(early):
    def plant(hidden, ids):
        _, a, b = victim(early)
        return zarr.open_array(str(early / VICTIM_SHARD / "hidden"), mode="r")[a:b]
    return plant


# (fault, array, change, checks that must fail and name the sample)
FAULTS = [
    ("hidden states shifted +1 position", "hidden", lambda h, i: np.roll(h, 1, axis=0), ["tail_recompute"]),
    ("hidden states shifted -1 position", "hidden", lambda h, i: np.roll(h, -1, axis=0), ["tail_recompute"]),
    ("all taps from the layer before", "hidden", "early", ["tail_recompute"]),
    ("stored argmax shifted by one", "target_argmax", lambda x, i: np.roll(x, 1), ["label_alignment", "tail_recompute"]),
    ("assistant header supervised", "loss_mask", header_supervised, ["mask_boundaries", "loss_mask"]),
    ("a user turn supervised", "loss_mask", user_supervised, ["mask_boundaries", "loss_mask"]),
    ("end-of-turn unsupervised", "loss_mask", end_unsupervised, ["mask_boundaries", "loss_mask"]),
    ("NaN in one tap", "hidden", nan_in_one_tap, ["finite"]),
    # Not the deepest tap, so the tail recompute cannot see it: the model-free tap signature does.
    ("two shallower taps swapped", "hidden", lambda h, i: h[:, [1, 0, 2]].copy(), ["tap_signature"]),
]


@pytest.mark.parametrize("fault, array, change, failing", FAULTS, ids=[f[0] for f in FAULTS])
def test_one_sample_fault_is_named(caches, tmp_path, fault, array, change, failing):
    good, early = caches
    cache = tmp_path / "cache"
    shutil.copytree(good, cache)
    rewrite(cache, array, from_early(early) if change == "early" else change)
    sid, _, _ = victim(cache)
    report = run_verify(VerifyOptions(cache=cache))  # in-process (the CLI path is the good-cache test below): default options
    assert not report["passed"], f"{fault}: verify passed"
    checks = {c["check"]: c for c in report["checks"]}
    assert checks["digests"]["status"] == "pass", "re-signed: only the content checks can see it"
    for name in failing:
        found = checks[name]
        assert found["status"] == "fail", (fault, name, found["summary"])
        named = " ".join(json.dumps(found["evidence"]).split())
        assert f"sample {sid} ({VICTIM_SHARD})" in found["summary"] + named, (fault, name, found)
        assert found["evidence"].get("offending_samples", 1) == 1 or name in ("mask_boundaries",), (fault, name, found)
    # Everything else about the cache is fine: the fault does not spill into unrelated checks.
    assert checks["structure"]["status"] == checks["completeness"]["status"] == "pass"


def test_the_good_cache_passes_every_sample(caches):
    good, _ = caches
    result = cli_here("verify-cache", str(good), "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 0, [c for c in report["checks"] if c["status"] != "pass"]
    checks = {c["check"]: c for c in report["checks"]}
    for name in ("mask_boundaries", "loss_mask", "tail_recompute"):
        assert checks[name]["evidence"]["samples"] == 32, (name, checks[name]["summary"])
    assert checks["tap_signature"]["status"] == "pass" and "32 samples" in checks["tap_signature"]["summary"]
    assert checks["label_alignment"]["evidence"]["samples"] == 32
    assert report["compute"] == {"device": "cpu", "dtype": "float32"}


def test_incomplete_cache_fails_completeness_and_train_refuses_it(caches, tmp_path):
    good, _ = caches
    cache = tmp_path / "cache"
    shutil.copytree(good, cache)
    shutil.rmtree(cache / "shard-00002")
    uncommit(cache, "shard-00003")  # its files stay: a partial write, invisible
    result = cli_here("verify-cache", str(cache), "--json")
    check = next(c for c in json.loads(result.stdout)["checks"] if c["check"] == "completeness")
    assert result.returncode == 1 and check["status"] == "fail"
    assert check["evidence"]["missing"] == ["shard-00002", "shard-00003"] and check["evidence"]["missing_rows"] == 16
    assert "2 of 4 shards not committed" in check["summary"]
    assert cli_here("verify-cache", str(cache), "--shards", "0-1", "--json").returncode == 0, "the committed part is sound"

    refused = cli("train", "--cache", str(cache), "--out", str(tmp_path / "run"), "--max-steps", "1")
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 1 and len(lines) == 1 and "incomplete cache" in lines[0] \
        and "--allow-incomplete-cache" in lines[0], refused.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
    allowed = cli_here("train", "--cache", str(cache), "--out", str(tmp_path / "run"), "--max-steps", "1",
                  "--allow-incomplete-cache")
    assert allowed.returncode == 0, allowed.stderr
    assert "incomplete cache" in allowed.stderr
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["incomplete_cache"]["missing"] == ["shard-00002", "shard-00003"]


def test_unknown_kernel_provenance_fails_verify_and_train(tmp_path, train_rows, monkeypatch):
    """transformers renames its internals: the kernel wrapper has no 'implementation' closure.
    Extraction records `unknown` (never a guess), verify fails on it, train refuses it."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    from pipeline.target_model.internals import LINEAR_ATTENTION_OPS
    from stages.train.run import run_train

    for attr in LINEAR_ATTENTION_OPS:
        original = getattr(modeling, attr)
        monkeypatch.setattr(modeling, attr, lambda *a, __f=original, **k: __f(*a, **k))
    data = write_rows(tmp_path / "convs.jsonl", train_rows[:6])
    run_extract(ExtractConfig(cache=str(tmp_path / "cache"), data=[str(data)], num_shards=2), None, progress=False)
    monkeypatch.undo()
    manifest = manifest_json(tmp_path / "cache")
    assert {r["kernels"]["path"] for r in manifest["shards"].values()} == {"unknown"}
    report = run_verify(VerifyOptions(cache=tmp_path / "cache", tail_rate=0))
    provenance = next(c for c in report["checks"] if c["check"] == "provenance")
    assert provenance["status"] == "fail" and "UNKNOWN" in provenance["summary"]
    with pytest.raises(PipelineError, match="kernel provenance unknown"):
        run_train(TrainConfig(job=Job(out=str(tmp_path / "run"), preset="tiny"), data=Data(cache=str(tmp_path / "cache")),
                              schedule=Schedule(max_steps=1)))
