"""Filesystem primitives for crash safety: fsync, atomic replace, advisory locks, digests."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import stat
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


def link_refused(path) -> PipelineError:
    return PipelineError(f"{path}: is a symbolic link; a cache holds regular files only")


def regular_files(root: Path) -> list[Path]:
    """Every file under root, sorted. A cache is untrusted input: a symbolic link (which could
    point at /dev/zero or outside the cache) or any other non-regular entry is refused, never
    followed."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise link_refused(path)
            if name in filenames:
                if not stat.S_ISREG(mode):
                    raise PipelineError(f"{path}: is not a regular file")
                found.append(path)
    return sorted(found)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def digest_of_files(files: dict[str, tuple[int, str]]) -> str:
    """One digest for a set of files from their (relative path, size, sha256): what the manifest
    records for a shard. Derived from per-file digests, so the writer never re-reads a file and
    verify can name the file that differs."""
    h = hashlib.sha256()
    for rel in sorted(files):
        size, sha = files[rel]
        h.update(f"{rel}\0{size}\0{sha}\n".encode())
    return h.hexdigest()


def hash_files(root: Path, files: list[Path]) -> dict[str, tuple[int, str]]:
    """{relative path: (size, sha256)} of files under root, read from disk."""
    return {p.relative_to(root).as_posix(): (p.stat().st_size, file_sha256(p)) for p in files}


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
