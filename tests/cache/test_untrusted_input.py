"""Caches and checkpoints are untrusted input (issue 9, security): nothing is unpickled, names
from a manifest cannot leave the cache, declared sizes are bounded before any allocation."""

import json
import shutil

import pytest
import torch
import zarr

from harness.caches import manifest_json, resign
from harness.runs import cli, cli_here, small_cache
from pipeline.cache.reader import CacheReader
from pipeline.errors import PipelineError
from stages.train.run import resolve_config, run_train


@pytest.fixture(scope="module")
def cache(tmp_path_factory, train_rows):
    return small_cache(tmp_path_factory.mktemp("untrusted"), train_rows[:40], 1)


def edited(cache, tmp_path, change):
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    change(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize("name", ["../shard-00000", "/etc/passwd", "shard-00000/../../x", "shard-1"])
def test_shard_names_cannot_leave_the_cache(cache, tmp_path, name):
    """Shard names in a manifest that lists its shards (caches before commit records); a commit
    record's shard name is its directory's, matched against shard-NNNNN."""
    def change(m):
        m["shards"][name] = manifest_json(cache)["shards"]["shard-00000"]
    bad = edited(cache, tmp_path, change)
    with pytest.raises(PipelineError, match="invalid shard name"):
        CacheReader(bad)
    run = cli if name == "../shard-00000" else cli_here  # one in a real process
    result = run("train", "--cache", str(bad), "--out", str(tmp_path / "run"), "--max-steps", "1")
    assert result.returncode == 1 and "invalid shard name" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_declared_huge_hidden_size_is_refused_before_allocation(cache, tmp_path):
    bad = edited(cache, tmp_path, lambda m: m["config"]["capture"].update(hidden_size=10**12))
    with pytest.raises(PipelineError, match=r"manifest.json: bad capture record .*hidden_size=1000000000000"):
        CacheReader(bad)


def test_a_shard_declaring_a_petabyte_array_is_refused_before_reading(cache, tmp_path):
    bad = tmp_path / "cache"
    shutil.copytree(cache, bad)
    meta = bad / "shard-00000" / "hidden" / "zarr.json"
    spec = json.loads(meta.read_text())
    spec["shape"] = [10**15, *spec["shape"][1:]]
    meta.write_text(json.dumps(spec))
    resign(bad, "shard-00000")  # the record matches again: the declared shape is what is checked
    reader = CacheReader(bad)
    with pytest.raises(PipelineError, match=r"hidden: declares shape \(1000000000000000, 3, 128\)"):
        reader.shard("shard-00000")
    verified = cli_here("verify-cache", str(bad), "--json")   # reported as a failed check, nothing allocated
    assert verified.returncode == 1
    structure = next(c for c in json.loads(verified.stdout)["checks"] if c["check"] == "structure")
    assert structure["status"] == "fail" and "declares shape (1000000000000000, 3, 128)" in json.dumps(structure)


def test_a_pickled_checkpoint_is_never_executed(cache, tmp_path):
    cfg, preset = resolve_config(None, {"cache": str(cache), "out": str(tmp_path / "run"), "max_steps": 1,
                                        "batch_sequences": 4, "micro_batch_sequences": 4})
    run_train(cfg, preset_target=preset, warn=lambda *_: None)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    checkpoint = next((tmp_path / "run" / "checkpoints").iterdir())
    torch.save({"state": {}, "param_groups": [], "evil": Payload()}, checkpoint / "optimizer.pt")
    with pytest.raises(PipelineError, match="optimizer or RNG state unreadable"):
        run_train(cfg, preset_target=preset, warn=lambda *_: None)
    assert not marker.exists()


def test_offsets_array_is_bounded_too(cache, tmp_path):
    bad = tmp_path / "cache"
    shutil.copytree(cache, bad)
    group = zarr.open_group(str(bad / "shard-00000"), mode="r")
    assert group["offsets"].shape[0] == 41  # 40 samples + 1
    meta = bad / "shard-00000" / "offsets" / "zarr.json"
    spec = json.loads(meta.read_text())
    spec["shape"] = [2**50]
    meta.write_text(json.dumps(spec))
    resign(bad, "shard-00000")
    with pytest.raises(PipelineError, match="offsets: declares shape"):
        CacheReader(bad).shard(0)


@pytest.mark.parametrize("command", ["train", "extract", "verify-cache"])
def test_a_manifest_of_an_unknown_schema_version_is_refused(cache, tmp_path, command):
    bad = edited(cache, tmp_path, lambda m: m.update(schema_version=99))
    before = (bad / "manifest.json").read_bytes()
    args = {"train": ["--cache", str(bad), "--out", str(tmp_path / "run"), "--max-steps", "1"],
            "extract": ["--cache", str(bad), "--num-shards", "1"], "verify-cache": [str(bad)]}[command]
    result = (cli if command == "train" else cli_here)(command, *args)  # one in a real process
    assert result.returncode == 1, result.stderr
    assert "schema_version 99 is not supported" in result.stdout + result.stderr
    assert (bad / "manifest.json").read_bytes() == before, "a refused cache is never rewritten"
    assert not (tmp_path / "run" / "checkpoints").exists()


def copied(cache, tmp_path):
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    return copy


def test_a_chunk_linked_to_dev_zero_is_reported_not_read(cache, tmp_path):
    """Following the link would read forever; verify-cache names it instead and reads nothing of it."""
    bad = copied(cache, tmp_path)
    chunk = max((bad / "shard-00000" / "hidden").glob("c.*"))
    assert chunk.is_file()
    chunk.unlink()
    chunk.symlink_to("/dev/zero")
    result = cli("verify-cache", str(bad), "--json", timeout=120)
    assert result.returncode == 1, result.stderr
    report = {c["check"]: c for c in json.loads(result.stdout)["checks"]}
    assert report["structure"]["status"] == "fail"
    assert any(f"{chunk}: is a symbolic link" in p for p in report["structure"]["evidence"]["problems"])
    assert report["digests"]["status"] == "fail"


@pytest.mark.parametrize("where", ["shard", "offsets chunk"])
def test_links_in_a_shard_are_refused_by_the_reader(cache, tmp_path, where):
    bad = copied(cache, tmp_path)
    if where == "shard":
        outside = tmp_path / "elsewhere"
        (bad / "shard-00000").rename(outside)
        (bad / "shard-00000").symlink_to(outside)
        link = bad / "shard-00000"
    else:
        link = bad / "shard-00000" / "offsets" / "c.0"
        target = tmp_path / "offsets-chunk"
        link.rename(target)
        link.symlink_to(target)
    with pytest.raises(PipelineError, match=f"{link}: is a symbolic link"):
        CacheReader(bad).shard("shard-00000")
    result = cli_here("train", "--cache", str(bad), "--out", str(tmp_path / "run"), "--max-steps", "1")
    assert result.returncode == 1 and "is a symbolic link" in result.stderr, result.stderr
