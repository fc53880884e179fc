"""`pipeline verify-cache` passes a good cache and catches each kind of damage, with evidence."""

import json
import shutil

import numpy as np
import pytest
import zarr

from extract_helpers import cli, write_rows
from pipeline.config import ExtractConfig
from stages.extract import run_extract


@pytest.fixture(scope="module")
def good(tmp_path_factory, train_rows):
    root = tmp_path_factory.mktemp("verify")
    data = write_rows(root / "convs.jsonl", train_rows[:24])
    cache = root / "cache"
    run_extract(ExtractConfig(cache=str(cache), data=[str(data)], num_shards=3), None, progress=False)
    return cache


@pytest.fixture
def copy(good, tmp_path):
    dest = tmp_path / "cache"
    shutil.copytree(good, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    return dest, manifest


def verify(cache, *args):
    result = cli("verify-cache", str(cache), "--json", *args)
    report = json.loads(result.stdout) if result.stdout.strip().startswith("{") else None
    return result, report


def status(report):
    return {c["check"]: c["status"] for c in report["checks"]}


def rewrite(cache, array, fn):
    """Rewrite one array of every shard through Zarr (valid checksums, wrong content)."""
    for shard in sorted(cache.glob("shard-*")):
        arr = zarr.open_array(str(shard / array), mode="r+")
        arr[:] = fn(arr[:])


def test_good_cache_passes_everything(good):
    result, report = verify(good, "--recompute", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert report["passed"]
    s = status(report)
    assert all(v == "pass" for v in s.values()), s
    assert {"structure", "digests", "checksums", "finite", "label_alignment", "topk_consistency", "provenance",
            "target_identity", "loss_mask", "recompute"} <= set(s)
    rates = next(c for c in report["checks"] if c["check"] == "label_alignment")["evidence"]["rates_by_shift"]
    assert rates["0"] > 0.98 and rates["-1"] < 0.5 and rates["1"] < 0.5
    recompute = next(c for c in report["checks"] if c["check"] == "recompute")["evidence"]
    assert recompute["best_hidden_state_index"] == {"1": {"2": 3}, "3": {"4": 3}, "5": {"6": 3}}


def test_flipped_byte_fails_checksums_and_digest(copy):
    cache, _ = copy
    chunk = sorted((cache / "shard-00001" / "hidden" / "c").rglob("*"))[-1]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    result, report = verify(cache)
    assert result.returncode == 1
    s = status(report)
    assert s["checksums"] == "fail" and s["digests"] == "fail"
    failures = next(c for c in report["checks"] if c["check"] == "checksums")["evidence"]["failures"]
    assert any("shard-00001/hidden" in f for f in failures)


def test_missing_shard_fails_structure(copy):
    cache, _ = copy
    shutil.rmtree(cache / "shard-00002")
    result, report = verify(cache)
    assert result.returncode == 1
    problems = next(c for c in report["checks"] if c["check"] == "structure")["evidence"]["problems"]
    assert "shard-00002: listed in the manifest but missing on disk" in problems


def test_shifted_labels_are_flagged_with_the_shift(copy):
    cache, _ = copy
    rewrite(cache, "target_argmax", lambda a: np.roll(a, 1))  # label of t now sits at t, one late
    result, report = verify(cache)
    assert result.returncode == 1
    check = next(c for c in report["checks"] if c["check"] == "label_alignment")
    assert check["status"] == "fail" and "shifted by +1" in check["summary"]


def test_swapped_taps_are_caught_by_recompute(copy):
    cache, _ = copy
    rewrite(cache, "hidden", lambda a: a[:, ::-1, :].copy())
    result, report = verify(cache, "--recompute", "2")
    assert result.returncode == 1
    check = next(c for c in report["checks"] if c["check"] == "recompute")
    assert check["status"] == "fail"
    assert check["evidence"]["best_hidden_state_index"]["1"] == {"6": 2}
    assert "tap 1 -> hidden_states[6]" in check["summary"]


def test_mask_off_by_one_is_caught(copy):
    cache, _ = copy
    rewrite(cache, "loss_mask", lambda a: np.roll(a, 1))
    result, report = verify(cache)
    assert result.returncode == 1
    check = next(c for c in report["checks"] if c["check"] == "loss_mask")
    assert check["status"] == "fail" and "loss_mask differs first at position" in check["evidence"]["mismatched"][0]


def test_mixed_kernel_provenance_is_flagged(copy):
    cache, manifest = copy
    manifest["shards"]["shard-00001"]["kernels"]["path"] = "fla"
    (cache / "manifest.json").write_text(json.dumps(manifest))
    result, report = verify(cache)
    assert result.returncode == 1
    assert "MIXED" in next(c for c in report["checks"] if c["check"] == "provenance")["summary"]


def test_unknown_schema_version(copy):
    cache, manifest = copy
    manifest["schema_version"] = 99
    (cache / "manifest.json").write_text(json.dumps(manifest))
    result, report = verify(cache)
    assert result.returncode == 1
    assert "schema_version 99 is not supported" in report["checks"][0]["summary"]


def test_sampled_checksums(good):
    result, report = verify(good, "--sample-rate", "0.5", "--seed", "1")
    assert result.returncode == 0
    checks = {c["check"]: c for c in report["checks"]}
    assert checks["digests"]["status"] == "skipped"
    ev = checks["checksums"]["evidence"]
    assert 0 < ev["decoded"] < ev["total"]


def test_show_highlights_the_supervised_span(good, train_rows):
    result = cli("verify-cache", str(good), "--show", "0")
    assert result.returncode == 0, result.stderr
    assert "sample 0 (shard-00000)" in result.stdout
    assert train_rows[0]["messages"][-1]["content"] in result.stdout
    assert "all checks passed" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["/nonexistent-cache"], "no such cache directory"),
    (["CACHE", "--shards", "7"], "--shards: '7' is outside 0-2"),
    (["CACHE", "--sample-rate", "0"], "--sample-rate must be in (0, 1]"),
    (["CACHE", "--show", "999"], "sample 999 is in no committed shard"),
])
def test_usage_errors_exit_2(good, args, message):
    args = [str(good) if a == "CACHE" else a for a in args]
    result = cli("verify-cache", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
