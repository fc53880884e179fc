"""`pipeline verify-cache` passes a good cache and catches each kind of damage, with evidence."""

import json
import shutil

import numpy as np
import pytest
import zarr

from harness.caches import damage_byte, edit_record, resign
from harness.runs import cli, cli_here, write_rows
from pipeline.config import ExtractConfig
from stages.extract.run import run_extract
from stages.verify_cache.options import VerifyOptions
from stages.verify_cache.run import run_verify


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


def verify(cache, *args, run=cli_here):
    """verify-cache --json, in this process (`run=cli`: a real one)."""
    result = run("verify-cache", str(cache), "--json", *args)
    report = json.loads(result.stdout) if result.stdout.strip().startswith("{") else None
    return result, report


def status(report):
    return {c["check"]: c["status"] for c in report["checks"]}


def test_good_cache_passes_everything(good):
    result, report = verify(good, "--recompute", "3", run=cli)
    assert result.returncode == 0, result.stdout + result.stderr
    assert report["passed"]
    s = status(report)
    assert all(v == "pass" for v in s.values()), s
    assert {"structure", "digests", "checksums", "finite", "label_alignment", "topk_consistency", "provenance",
            "target_identity", "loss_mask", "recompute"} <= set(s)
    rates = next(c for c in report["checks"] if c["check"] == "label_alignment")["evidence"]["rates_by_shift"]
    assert rates["0"] > 0.98 and rates["-1"] < 0.5 and rates["1"] < 0.5
    recompute = next(c for c in report["checks"] if c["check"] == "recompute")["evidence"]
    # --recompute 3 over 3 shards: one sample of every shard plus the longest, so 4.
    assert recompute["best_hidden_state_index"] == {"1": {"2": 4}, "3": {"4": 4}, "5": {"6": 4}}
    assert {p.split()[0] for p in recompute["picked"]} == {"shard-00000", "shard-00001", "shard-00002"}
    from pipeline.cache.reader import CacheReader
    reader = CacheReader(good)
    lengths = {(name, row): int(n) for name in reader.shards for row, n in enumerate(np.diff(reader.shard(name).offsets))}
    name, row = max(lengths, key=lengths.get)
    assert f"{name} row {row}" in recompute["picked"], "the longest sample is always recomputed"
    tail = next(c for c in report["checks"] if c["check"] == "tail_recompute")["evidence"]
    assert tail["samples"] == 24 and tail["layers_run"] == 2 and tail["num_hidden_layers"] == 8


IM_START, IM_END = 497, 498  # the shipped tokenizer's ids; test_fault_ids checks them


def per_shard(cache, array, fn, *extra):
    """Rewrite one array of every shard through Zarr (valid checksums, wrong content), and its
    commit record to match, as an extractor with that bug would have written it."""
    for shard in sorted(cache.glob("shard-*")):
        arrays = [zarr.open_array(str(shard / name), mode="r+") for name in (array, *extra)]
        arrays[0][:] = fn(*(arr[:] for arr in arrays))
        resign(cache, shard.name)


def span_starts(mask):
    return np.nonzero((mask == 1) & (np.concatenate([[0], mask[:-1]]) == 0))[0]


def mask_over_header(mask, ids):
    out = mask.copy()
    for t in span_starts(mask):
        out[t - 3:t] = 1
    return out


def mask_over_user(mask, ids, user_id):
    out = mask.copy()
    for t in np.nonzero(ids == IM_START)[0]:
        if t + 1 < len(ids) and ids[t + 1] == user_id:
            end = t + np.argmax(ids[t:] == IM_END)
            out[t + 3:end + 1] = 1
    return out


def unmask_im_end(mask, ids):
    out = mask.copy()
    out[(ids == IM_END) & (mask == 1)] = 0
    return out


def nan_in_tap(hidden):
    out = hidden.copy()
    out[::7, 1, :4] = 0x7FC0  # bfloat16 NaN bit pattern, tap index 1 (layer 3)
    return out


def set_identity(cache, shard, **changes):
    edit_record(cache, shard, lambda record: record["identity"].update(changes))
    group = zarr.open_group(str(cache / shard), mode="r+")
    group.attrs["identity"] = {**group.attrs["identity"], **changes}
    resign(cache, shard)


def flip_byte(cache):
    chunk = sorted((cache / "shard-00001" / "hidden").glob("c.*"))[-1]
    damage_byte(chunk, chunk.stat().st_size // 2, 0x01)


def copy_hidden_from(other):
    def plant(cache):
        for shard in sorted(cache.glob("shard-*")):
            shutil.rmtree(shard / "hidden")
            shutil.copytree(other / shard.name / "hidden", shard / "hidden")
            resign(cache, shard.name)
    return plant


def kernels_fla(record):
    record["kernels"]["path"] = "fla"


def more_tokens(record):
    record["tokens"] += 1


# (fault, plant(cache, ctx), extra verify args, failing check, message fragment)
FAULTS = [
    ("hidden states shifted by one position", lambda c, x: per_shard(c, "hidden", lambda a: np.roll(a, 1, axis=0)),
     ["--recompute", "2"], "recompute", "hidden states shifted by +1 position"),
    ("taps taken from hidden_states[i] instead of [i+1]", lambda c, x: copy_hidden_from(x["layers_024"])(c),
     ["--recompute", "2"], "recompute", "tap 1 -> hidden_states[1]"),
    ("two taps swapped", lambda c, x: per_shard(c, "hidden", lambda a: a[:, [1, 0, 2], :].copy()),
     ["--recompute", "2"], "recompute", "tap 1 -> hidden_states[4]"),
    ("loss mask extended over the assistant header", lambda c, x: per_shard(c, "loss_mask", mask_over_header, "input_ids"),
     [], "mask_boundaries", "assistant header supervised"),
    ("loss mask covering a user turn", lambda c, x: per_shard(c, "loss_mask", lambda m, i: mask_over_user(m, i, x["user_id"]), "input_ids"),
     [], "mask_boundaries", "user turn supervised"),
    ("<|im_end|> unmasked", lambda c, x: per_shard(c, "loss_mask", unmask_im_end, "input_ids"),
     [], "mask_boundaries", "end-of-turn token not supervised"),
    ("a flipped byte in one chunk", lambda c, x: flip_byte(c), [], "checksums", "shard-00001/hidden chunk"),
    ("a missing chunk", lambda c, x: (c / "shard-00001" / "target_argmax" / "c.0").unlink(),
     [], "structure", "shard-00001: its commit record does not match its files (target_argmax/c.0 is listed but missing)"),
    ("a shard missing from disk", lambda c, x: shutil.rmtree(c / "shard-00002"),
     [], "completeness", "1 of 3 shards not committed (shard-00002)"),
    ("token count mismatch", lambda c, x: edit_record(c, "shard-00000", more_tokens), [], "structure", "manifest says"),
    ("NaN injected into one tap", lambda c, x: per_shard(c, "hidden", nan_in_tap), [], "finite", "tap 3: "),
    ("one shard with another tokenizer digest", lambda c, x: set_identity(c, "shard-00001", tokenizer_files_sha256="0" * 64),
     [], "provenance", "shard-00001: tokenizer_files_sha256"),
    ("one shard with different kernel provenance", lambda c, x: edit_record(c, "shard-00001", kernels_fla), [],
     "provenance", "MIXED"),
]


@pytest.fixture(scope="module")
def context(tmp_path_factory, good, tokenizer):
    """What some faults need: a cache tapped one layer early, and the id of 'user'."""
    root = tmp_path_factory.mktemp("faults")
    manifest = json.loads((good / "manifest.json").read_text())
    other = root / "layers_024"
    run_extract(ExtractConfig(cache=str(other), data=manifest["sources"]["data"], num_shards=3, layers=[0, 2, 4]),
                None, progress=False)
    return {"layers_024": other, "user_id": tokenizer("user", add_special_tokens=False)["input_ids"][0]}


def test_fault_ids(tokenizer):
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [IM_START, IM_END]


@pytest.mark.parametrize("fault, plant, args, check, message", FAULTS, ids=[f[0] for f in FAULTS])
def test_planted_fault_is_named(good, context, tmp_path, fault, plant, args, check, message):
    cache = tmp_path / "cache"
    shutil.copytree(good, cache)
    plant(cache, context)
    # In-process (the CLI's report is the same dict; test_good_cache_passes_everything runs the CLI).
    report = run_verify(VerifyOptions(cache=cache, recompute=int(args[1]) if args else 0))
    assert not report["passed"], f"{fault}: verify passed"
    found = next(c for c in report["checks"] if c["check"] == check)
    text = found["summary"] + " " + json.dumps(found["evidence"])
    assert found["status"] == "fail" and message in text, f"{fault}: {found}"


def test_shifted_labels_are_flagged_with_the_shift(copy):
    cache, _ = copy
    per_shard(cache, "target_argmax", lambda a: np.roll(a, 1))  # label of t now sits at t, one late
    result, report = verify(cache)
    assert result.returncode == 1
    check = next(c for c in report["checks"] if c["check"] == "label_alignment")
    assert check["status"] == "fail" and "shifted by +1" in check["summary"]


def test_mask_off_by_one_is_caught_by_rederivation(copy):
    cache, _ = copy
    per_shard(cache, "loss_mask", lambda a: np.roll(a, 1))
    result, report = verify(cache)
    assert result.returncode == 1
    check = next(c for c in report["checks"] if c["check"] == "loss_mask")
    assert check["status"] == "fail" and "loss_mask differs first at position" in check["evidence"]["first_offending"][0]


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
    result = cli_here("verify-cache", str(good), "--show", "0")
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
    result = (cli if args[0] == "/nonexistent-cache" else cli_here)("verify-cache", *args)  # one in a real process
    assert result.returncode == 2 and message in result.stderr, result.stderr
