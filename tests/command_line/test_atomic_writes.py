"""pipeline.files.write_atomic and write_json_atomic, observed from outside: a real child process
writing a large file is killed with SIGKILL in the middle of its write (at a random instant, or at
the failpoint between the temporary's fsync and its rename), and the target is then read back as
bytes: the whole old content, or the whole new content, never a part. The durability steps are
observed by recording which paths the fsyncs reach (through /proc/self/fd) around the rename."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from harness.runs import REPO
from pipeline.errors import PipelineError
from pipeline.files import write_atomic, write_json_atomic

BLOCK = 1 << 16
BLOCKS = 128  # 8 MiB, written by the child in about half a second: a kill lands inside the write
OLD = b"o" * (3 * BLOCK + 17)

# The child writes BLOCKS blocks of b"n" through a generator, sleeping between blocks so that the
# parent can kill it mid-write; it says "writing" once the first block has been handed to the write.
CHILD = f"""
import sys, time
from pathlib import Path
from pipeline.files import write_atomic

def blocks():
    for i in range({BLOCKS}):
        if i == 1:
            print("writing", flush=True)
        time.sleep(float(sys.argv[2]))
        yield b"n" * {BLOCK}

write_atomic(Path(sys.argv[1]), blocks())
print("done", flush=True)
"""
NEW = b"n" * (BLOCK * BLOCKS)


def start_child(target, pause: float, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(target), str(pause)], cwd=REPO,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def others(target) -> list[str]:
    """The names beside the target, but the target's own."""
    return sorted(p.name for p in target.parent.iterdir() if p.name != target.name)


def looks_temporary(name: str, target) -> bool:
    """Hidden and marked as a temporary of the target, as any listing of the project skips it."""
    return name.startswith(f".{target.name}.tmp-")


@pytest.mark.parametrize("before", [OLD, None], ids=["replacing", "creating"])
def test_a_kill_at_random_instants_leaves_the_old_file_or_the_new_one(tmp_path, before):
    """Six children killed at random instants of their write (and one left to finish): each time
    the target holds exactly the old bytes (or is absent, when there was none) or exactly the new
    ones; whatever else is left is a hidden temporary of it."""
    rng = random.Random(0)
    seen = set()
    for trial in range(7):
        folder = tmp_path / f"trial-{trial}"
        folder.mkdir()
        target = folder / "data.bin"
        if before is not None:
            target.write_bytes(before)
        child = start_child(target, pause=0.004)
        assert child.stdout.readline() == b"writing\n", child.stderr.read()
        if trial < 6:
            time.sleep(rng.uniform(0.0, 0.6))
            child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        found = target.read_bytes() if target.exists() else None
        assert found == before or found == NEW, (trial, None if found is None else len(found))
        seen.add("new" if found == NEW else "old")
        assert all(looks_temporary(name, target) for name in others(target)), others(target)
        if child.returncode == 0:
            assert found == NEW and others(target) == []
    assert "old" in seen and "new" in seen, seen  # the kills landed inside writes, and one finished


def test_a_kill_between_the_fsync_and_the_rename_leaves_the_old_file(tmp_path):
    """At the failpoint after the temporary is whole and synced, before the rename: the target is
    still the old file; the whole new content exists only under the temporary's hidden name."""
    target = tmp_path / "data.bin"
    target.write_bytes(OLD)
    child = start_child(target, pause=0.0, env={"PIPELINE_FAILPOINT": "atomic.synced@1"})
    out, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, err
    assert b"done" not in out
    assert target.read_bytes() == OLD
    [left] = others(target)
    assert looks_temporary(left, target)
    assert (tmp_path / left).read_bytes() == NEW


def test_a_failing_source_leaves_the_target_and_no_temporary(tmp_path):
    target = tmp_path / "data.bin"
    target.write_bytes(OLD)

    def broken():
        yield b"n" * BLOCK
        raise ValueError("the source failed")

    with pytest.raises(ValueError, match="the source failed"):
        write_atomic(target, broken())
    assert target.read_bytes() == OLD and others(target) == []


def test_the_json_variant_writes_what_json_reads_back(tmp_path):
    target = tmp_path / "record.json"
    record = {"step": 12, "loss": 0.25, "name": "tâche ✓", "nested": {"b": [1, 2.5, None, True], "a": "x"}}
    write_json_atomic(target, record)
    assert json.loads(target.read_text(encoding="utf-8")) == record
    write_json_atomic(target, {"replaced": True})
    assert json.loads(target.read_text(encoding="utf-8")) == {"replaced": True}
    assert others(target) == []


def test_the_json_variant_names_the_file_when_the_write_fails(tmp_path):
    target = tmp_path / "missing-folder" / "record.json"
    with pytest.raises(PipelineError, match=r"record\.json: write failed .*the previous version is intact"):
        write_json_atomic(target, {"a": 1})


def test_the_file_is_synced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    """The events as the kernel sees them: which path each fsync'd descriptor names, and the
    rename, in order."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "data.bin"
    target.write_bytes(OLD)
    write_atomic(target, b"new content")
    assert target.read_bytes() == b"new content"

    folder, target_path = os.path.realpath(tmp_path), os.path.realpath(target)
    [(_, temporary, renamed_to)] = [e for e in events if e[0] == "replace"]
    assert renamed_to == target_path and looks_temporary(os.path.basename(temporary), target)
    assert events == [("fsync", temporary), ("replace", temporary, target_path), ("fsync", folder)]
