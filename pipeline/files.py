"""Filesystem primitives for crash safety: fsync, atomic replace, advisory locks, digests."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.faults import failpoint

_REASONS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
            errno.EFBIG: "file size limit reached (ulimit -f)", errno.EROFS: "read-only file system"}
STORAGE_ERRNOS = frozenset(_REASONS)


def describe_os_error(e: OSError) -> str:
    return _REASONS.get(e.errno, e.strerror or str(e))


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under root (and root), so a rename after it is durable."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data) -> None:
    """Write to a temporary, fsync, rename: readers see the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        failpoint("json.written")
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PipelineError(f"{path}: write failed ({describe_os_error(e)}); the previous version is intact") from None


def digest_of_files(files: dict[str, tuple[int, str]]) -> str:
    """One digest for a set of files from their (relative path, size, sha256): what the manifest
    records for a shard. Derived from per-file digests, so the writer never re-reads a file and
    verify can name the file that differs."""
    h = hashlib.sha256()
    for rel in sorted(files):
        size, sha = files[rel]
        h.update(f"{rel}\0{size}\0{sha}\n".encode())
    return h.hexdigest()


class FileLock:
    """Exclusive advisory lock (flock) on a file. `acquire(blocking=False)` returns False when
    another process holds it. Released on close or when the process dies (even by kill -9)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self, blocking: bool = True) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:  # no working flock on this mount (ENOLCK, EOPNOTSUPP), an interrupt: no fd left open
            os.close(fd)
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
