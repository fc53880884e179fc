"""Faults during extraction: kill -9 at every phase, a full disk, a file-size limit. After each,
the cache lists only whole shards, and re-running the same command completes it to exactly the
content of an uninterrupted run."""

import json
import sys

from harness.caches import assert_same_content, manifest_json, shard_digest
from harness.kill_trials import BATCH_TOKENS, SHARDS, checked_trials
from harness.marks import needs_tmpfs
from harness.runs import cli, cli_here, file_size_limit, in_namespace


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
    aimed = checked_trials(tmp_path, data, reference, per_failpoint=3, timed=3)
    # The phases left what they should: a kill after the files, before the record, leaves a shard
    # directory that no reader sees and the resume redoes; one right after the record, a committed shard.
    assert all(t["after_kill"]["partial"] for t in aimed if t["failpoint"].startswith("writer.fsynced"))
    assert all(t["after_kill"]["listed"] for t in aimed if t["failpoint"].startswith("writer.committed"))


def test_file_size_limit_during_a_shard_write(tmp_path, data, reference):
    cache = tmp_path / "cache"
    first = cli_here(*extract_args(cache, data), "--shards", "0")
    assert first.returncode == 0, first.stderr

    limited = cli(*extract_args(cache, data), preexec_fn=file_size_limit(30_000))
    assert limited.returncode == 1
    lines = [line for line in limited.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "shard-00001: write failed (file size limit reached" in lines[0], limited.stderr
    assert "Traceback" not in limited.stderr
    assert sorted(listed(cache)) == ["shard-00000"]
    assert_consistent(cache)
    resumed = cli_here(*extract_args(cache, data), "--json")
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
