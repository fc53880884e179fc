"""Faults during extraction: kill -9 at every phase, a full disk, a file-size limit. After each,
the cache lists only whole shards, and re-running the same command completes it to exactly the
content of an uninterrupted run."""

import json
import os
import subprocess
import sys

import pytest

from extract_helpers import (REPO, assert_same_content, cli, file_size_limit, in_namespace, manifest_json, needs_tmpfs,
                             shard_digest)
from stages.verify import run_verify

SHARDS, BATCH_TOKENS = 3, 256
PHASES = {"extract.batch", "extract.encoded", "writer.chunk", "writer.fsynced", "writer.committed"}


@pytest.fixture(scope="module")
def data(twelve_rows_cache):
    return twelve_rows_cache["data"]


@pytest.fixture(scope="module")
def reference(twelve_rows_cache):
    """The conftest's cache of these rows: SHARDS shards of BATCH_TOKENS-token batches."""
    assert (SHARDS, BATCH_TOKENS) == (3, 256)  # what the shared cache was extracted with
    return twelve_rows_cache["cache"]


def extract_args(cache, data):
    return ["extract", "--cache", str(cache), "--data", str(data), "--num-shards", str(SHARDS),
            "--batch-tokens", str(BATCH_TOKENS)]


def listed(cache):
    return manifest_json(cache)["shards"]


def assert_consistent(cache):
    """Every committed shard is on disk byte for byte as recorded; a failed write left no
    partial shard behind (the writer removes what it wrote)."""
    for name, record in listed(cache).items():
        assert shard_digest(cache / name) == record["digest"], name
    assert sorted(p.name for p in cache.glob("shard-*")) == sorted(listed(cache))


def test_kill_9_at_every_phase_of_extraction(tmp_path, data, reference):
    """18 trials: 3 at random hits of each of 5 failpoints (forward batch, sample encoded, file
    of chunks compressed and written, shard's files durable before its record, record written)
    and 3 kills after a random delay (test_object_store.py runs the same against a bucket); the writer runs inline in half of them and on its background thread in the
    other half."""
    aimed = kill_trials(tmp_path, data, reference, per_failpoint=3, timed=3)
    # The phases left what they should: a kill after the files, before the record, leaves a shard
    # directory that no reader sees and the resume redoes; one right after the record, a committed shard.
    assert all(t["after_kill"]["partial"] for t in aimed if t["failpoint"].startswith("writer.fsynced"))
    assert all(t["after_kill"]["listed"] for t in aimed if t["failpoint"].startswith("writer.committed"))


def kill_trials(tmp_path, data, reference, *, per_failpoint: int, timed: int, s3: dict | None = None,
                env: dict | None = None) -> list[dict]:
    """Run tests/kill_trials.py and check every trial: nothing partial ever looks committed, every
    resume completes exactly the missing shards, and the content equals an uninterrupted run's.
    Returns the trials aimed at failpoints."""
    plan = {"root": str(tmp_path), "data": str(data), "num_shards": SHARDS, "batch_tokens": BATCH_TOKENS,
            "seed": 9, "per_failpoint": per_failpoint, "timed": timed, **({"s3": s3} if s3 else {}),
            # small files, so that kills land between the file writes of a shard, not only at its commit
            "chunking": {"hidden_chunk_bytes": 8192, "hidden_chunks_per_file": 4, "small_chunk_tokens": 256,
                         "small_chunks_per_file": 4}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    result = subprocess.run([sys.executable, "tests/kill_trials.py", str(tmp_path / "plan.json")], cwd=REPO,
                            capture_output=True, text=True, timeout=900,
                            env={**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "PIPELINE_FAILPOINT": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    trials = report["trials"]
    aimed = [t for t in trials if "failpoint" in t]
    assert len(aimed) == per_failpoint * len(PHASES) and all(t["run"] == "killed" for t in aimed), [t["run"] for t in aimed]
    assert {t["failpoint"].split("@")[0] for t in aimed} == PHASES
    assert sum(t["run"] == "killed" for t in trials) >= len(aimed) + (1 if timed else 0)
    for t in trials:
        after = t["after_kill"]
        assert after["listed_intact"], t  # never a partial shard listed as committed
        assert t["resume"] == "ok", t
        assert t["resumed_shards_written"] == SHARDS - len(after["listed"]), t
        done = t["after_resume"]
        assert len(done["listed"]) == SHARDS and done["listed_intact"], t
        assert not done["partial"], t
        cache = tmp_path / os.path.basename(t["cache"])
        assert_same_content(cache, reference)
        assert run_verify(cache, tail_rate=0)["passed"], t  # content is already compared exactly above
    return aimed


def test_file_size_limit_during_a_shard_write(tmp_path, data, reference):
    cache = tmp_path / "cache"
    first = cli(*extract_args(cache, data), "--shards", "0")
    assert first.returncode == 0, first.stderr

    limited = cli(*extract_args(cache, data), preexec_fn=file_size_limit(30_000))
    assert limited.returncode == 1
    lines = [line for line in limited.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "shard-00001: write failed (file size limit reached" in lines[0], limited.stderr
    assert "Traceback" not in limited.stderr
    assert sorted(listed(cache)) == ["shard-00000"]
    assert_consistent(cache)
    resumed = cli(*extract_args(cache, data), "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["shards_written"] == SHARDS - 1
    assert_same_content(cache, reference)


@needs_tmpfs
def test_disk_full_during_a_shard_write(tmp_path, data, reference):
    """A real ENOSPC: the cache lives on a tmpfs that has room for one shard; the extraction
    fails naming the next shard, then the filesystem is grown and the same command completes."""
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    cache = mnt / "cache"
    extract = " ".join([sys.executable, "-m", "cli", *extract_args(cache, data)])
    in_namespace(f"""
mount -t tmpfs -o size=16m tmpfs {mnt}
{extract} --shards 0 > /dev/null 2> {out}/first.err || exit 10
used=$(du -sk {mnt} | cut -f1)
mount -o remount,size=$((used + 40))k {mnt}
{extract} > /dev/null 2> {out}/full.err
echo $? > {out}/full.rc
cp -r {cache} {out}/after-failure
mount -o remount,size=16m {mnt}
{extract} --json > {out}/resumed.json 2> {out}/resumed.err || exit 11
cp -r {cache} {out}/final
""", out)
    assert (out / "full.rc").read_text().strip() == "1"
    stderr = (out / "full.err").read_text()
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "write failed (no space left on the device)" in lines[0], stderr
    assert "shard-00001" in lines[0] or "shard-00002" in lines[0], lines[0]
    assert "Traceback" not in stderr
    after = out / "after-failure"
    assert "shard-00000" in listed(after) and len(listed(after)) < SHARDS
    assert_consistent(after)
    assert json.loads((out / "resumed.json").read_text())["shards_written"] == SHARDS - len(listed(after))
    assert_same_content(out / "final", reference)
