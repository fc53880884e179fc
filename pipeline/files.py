"""Filesystem primitives for crash safety: fsync, atomic replace, advisory locks, digests."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import threading
from pathlib import Path
from typing import Iterable

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


# A temporary's name: hidden, beside its target (a rename is atomic only within one filesystem),
# unique per process and thread (threads of one process may write the same target at once).
# A cache directory's listing skips these names and a local copy removes them when it opens; a
# bare `.tmp-PID` is the form earlier versions wrote, still recognised.
_TEMPORARY = re.compile(r"^\.(?P<target>.+)\.tmp-\d+(?:-\d+)?$")


def temporary_for(path: Path) -> Path:
    """Where `write_atomic` writes `path` before renaming it: `.NAME.tmp-PID-THREAD`."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_native_id()}")


def temporary_target(name: str) -> str | None:
    """The file name a temporary of `write_atomic` was to become; None for any other name."""
    found = _TEMPORARY.match(name)
    return found.group("target") if found else None


def write_synced(path: Path, data: bytes | Iterable[bytes]) -> None:
    """Create (or truncate) `path` with `data`, flushed and fsynced before returning: its bytes
    are on the disk, though its name may not be until its directory is fsynced. An iterable of
    blocks is written as it is produced (a download, say), never held whole."""
    with open(path, "wb") as f:
        for block in (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data:
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, data: bytes | Iterable[bytes]) -> None:
    """Replace `path` with `data` so that readers, and the disk after a crash or a power loss,
    see the old file or the whole new one, never a part: written to a temporary beside it and
    fsynced, renamed over it, then the directory fsynced so that the rename itself is durable.
    A failure before the rename (an OSError, or an exception from the iterable) removes the
    temporary and propagates with `path` untouched; a kill leaves at most the temporary, whose
    name `temporary_target` recognises."""
    path = Path(path)
    tmp = temporary_for(path)
    try:
        write_synced(tmp, data)
        failpoint("atomic.synced")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, data) -> None:
    """`write_atomic` of `data` as indented JSON with sorted keys and a final newline; a failed
    write is one PipelineError naming the file and the reason."""
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    try:
        write_atomic(path, text.encode("utf-8"))
    except OSError as e:
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
