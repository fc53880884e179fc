"""Shared helpers for extract tests: small datasets from the shipped one, running the real CLI,
and comparing two caches' decoded content."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.cache.reader import CacheReader

REPO = Path(__file__).resolve().parent.parent
ARRAYS = ("input_ids", "loss_mask", "target_argmax", "target_topk_ids", "target_topk_logits", "target_logsumexp")


def manifest_json(cache: Path) -> dict:
    """The manifest as stored on disk, with "shards" as the commit protocol defines them (DESIGN 11:
    each shard whose digests.json holds a shard record and whose listed files are there with
    those sizes), read without the tool's own parser."""
    manifest = json.loads((Path(cache) / "manifest.json").read_text())
    for record_path in sorted(Path(cache).glob("shard-*/digests.json")):
        listing = json.loads(record_path.read_text())
        files_ok = all((record_path.parent / rel).is_file() and (record_path.parent / rel).stat().st_size == f["bytes"]
                       for rel, f in listing["files"].items())
        if "shard" in listing and files_ok:
            manifest["shards"][record_path.parent.name] = listing["shard"]
    return manifest


def write_rows(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def small_cache(root: Path, rows: list[dict], num_shards: int) -> Path:
    """A cache at root/cache of the given conversations, extracted in-process with defaults."""
    from pipeline.config import ExtractConfig
    from stages.extract import run_extract

    data = write_rows(root / "convs.jsonl", rows)
    run_extract(ExtractConfig(cache=str(root / "cache"), data=[str(data)], num_shards=num_shards), None, progress=False)
    return root / "cache"


def cli(*args: str, env: dict | None = None, timeout: int = 600, preexec_fn=None) -> subprocess.CompletedProcess:
    """Run `python -m cli ...` in a subprocess, as a user would run `pipeline ...`."""
    full_env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None in `env`: unset it
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=REPO, preexec_fn=preexec_fn)


def cli_here(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The same command run in this process by typer's test runner: the same app, options,
    stdout, stderr and exit code as `cli`, without the seconds a new process spends importing
    torch. For commands that end early (usage and input errors, refusals); process-level
    behaviour (kills, signals, stray library output, the console script) stays with `cli`, and
    each family of such tests keeps at least one case there. An unexpected exception becomes
    exit code 1 with its traceback on stderr, as in a process."""
    import traceback

    import torch
    from typer.testing import CliRunner

    from cli import app

    threads = torch.get_num_threads()  # the CLI sets torch's threads for its process
    try:
        result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1", **(env or {})})
    finally:
        torch.set_num_threads(threads)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["pipeline", *args], result.exit_code, result.stdout, stderr)


def torchrun(nproc: int, *args: str, timeout: int = 600, preexec_fn=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--master-port", str(29500 + os.getpid() % 1000), "-m", "cli", *args],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO, preexec_fn=preexec_fn)


def file_size_limit(nbytes: int):
    """A preexec_fn: writes past `nbytes` fail with EFBIG (SIGXFSZ ignored, so they do not kill)."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return limit


def decoded(cache: Path) -> dict[int, dict[str, np.ndarray]]:
    reader = CacheReader(cache)
    out = {}
    for name in reader.shards:
        shard = reader.shard(name)
        for sid in shard.sample_ids:
            sample = {k: shard.read(k, int(sid)) for k in ARRAYS}
            sample["hidden"] = shard.hidden(int(sid)).float().numpy()
            out[int(sid)] = sample
    return out


def assert_same_content(a: Path, b: Path, *, exact: bool = True, atol: float = 0.0) -> None:
    da, db = decoded(a), decoded(b)
    assert sorted(da) == sorted(db), "different sample ids"
    for sid in da:
        for key in (*ARRAYS, "hidden"):
            x, y = da[sid][key], db[sid][key]
            assert x.shape == y.shape, (sid, key)
            if exact or key in ("input_ids", "loss_mask"):
                assert np.array_equal(x, y), (sid, key)
            elif key in ("target_argmax", "target_topk_ids"):
                assert (x == y).mean() > 0.99, (sid, key)
            else:
                np.testing.assert_allclose(x, y, atol=atol, rtol=0.02, err_msg=f"sample {sid} {key}")


def _can_mount_a_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


# A real full disk: a small tmpfs mounted in a private user + mount namespace, grown later with
# `mount -o remount,size=...` to show the run resumes once there is room.
needs_tmpfs = pytest.mark.skipif(not _can_mount_a_tmpfs(), reason="needs user and mount namespaces (unshare -rm)")


def in_namespace(script: str, out: Path) -> None:
    """Run a shell script in a private user + mount namespace, where it may mount a tmpfs; the
    script leaves its evidence in `out` (outside the mount). Fails showing the *.err files."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", "set -u\n" + script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr, *(p.read_text() for p in out.glob("*.err")))


def shard_digest(shard_dir: Path) -> str:
    """The digest of a shard as it is on disk, derived from its files' bytes."""
    from pipeline.files import digest_of_files

    return "sha256:" + digest_of_files(hash_files_on_disk(shard_dir))


def hash_files_on_disk(shard_dir: Path) -> dict:
    """{relative path: (size, sha256)} of every file of a shard but digests.json, from disk (a
    '.NAME.tmp-PID' left by a kill inside a small-file write is not a file of the shard)."""
    import hashlib

    return {p.relative_to(shard_dir).as_posix(): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(shard_dir.rglob("*"))
            if p.is_file() and p.name != "digests.json" and not (p.name.startswith(".") and ".tmp-" in p.name)}


def edit_record(cache: Path, name: str, change) -> None:
    """Apply `change` to a committed shard's record (in its digests.json, the commit record), as a
    writer with a bug would have written it."""
    path = Path(cache) / name / "digests.json"
    listing = json.loads(path.read_text())
    change(listing["shard"])
    path.write_text(json.dumps(listing))


def uncommit(cache: Path, name: str) -> None:
    """Remove a shard's commit record: its files stay, no reader sees them."""
    (Path(cache) / name / "digests.json").unlink()


def resign(cache: Path, name: str) -> None:
    """Make a deliberately edited shard's digests (digests.json and the manifest) match its bytes
    again, so a test reaches the check it is about instead of stopping at the digest check."""
    from pipeline.cache.commit import record_bytes
    from pipeline.files import digest_of_files

    files = hash_files_on_disk(cache / name)
    path = cache / name / "digests.json"
    shard = json.loads(path.read_text())["shard"]
    shard.update(digest="sha256:" + digest_of_files(files), bytes=sum(size for size, _ in files.values()))
    path.write_bytes(record_bytes(files, shard))
