"""Where a cache lives: a local (or shared POSIX) directory, or an object-store prefix (DESIGN 11).

A cache is addressed by a location string: a path, `file://PATH`, or `s3://BUCKET/PREFIX`.
Everything the cache code does to storage goes through `Location`, with keys relative to the
cache's root ('manifest.json', 'shard-00003/hidden/c.0.0.0'):

- a create-if-absent write of a whole object (`put_if_absent`), the only primitive the commit
  protocol needs: no rename of a directory, no lock (Zarr writes the shard's files through its store);
- a recursive listing with sizes (`listing`), whole reads, range reads (`read_ranges`, adjacent
  ranges coalesced by the backend), streaming reads for hashing (`stream`);
- a Zarr store rooted at a key prefix (`zarr_store`), so writer and reader use Zarr on both.

A directory still gets durable writes (fsync) and atomic small files (temporary + rename, which
every POSIX filesystem has; `flock` is not needed). An object store write is atomic by nature.
The object-store backend is in pipeline/cache/object_store.py (an optional extra); a location
string becomes a `Location` in pipeline/cache/address.py, the one module that knows both.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path
from typing import Iterator

from pipeline.files import describe_os_error, fsync_dir, temporary_for, temporary_target, write_synced
from pipeline.errors import PipelineError

STREAM_BLOCK = 1 << 22


class Location:
    """A cache's root. Subclasses implement the primitives; keys use '/' on every backend."""

    url: str
    remote: bool = False
    requests: int | None = None  # requests made so far, where the backend counts them (object stores)

    def where(self, key: str = "") -> str:
        """The location of `key` as a user would write it (for messages)."""
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    def read(self, key: str) -> bytes | None:
        """The whole object, or None when there is none."""
        raise NotImplementedError

    def read_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[memoryview]:
        """[start, end) byte ranges of one object, in order."""
        raise NotImplementedError

    def stream(self, key: str) -> Iterator[bytes]:
        """The object's bytes in blocks (hashing without a local copy)."""
        raise NotImplementedError

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create `key` with `data` unless it exists (then False, nothing written)."""
        raise NotImplementedError

    def listing(self, prefix: str = "") -> dict[str, int]:
        """{key: size} of every object under prefix (a key prefix ending in '/', or '')."""
        raise NotImplementedError

    def delete_prefix(self, prefix: str) -> None:
        """Remove every object under prefix ('shard-00003/')."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Remove one object (nothing happens when there is none)."""
        raise NotImplementedError

    def some_keys(self, limit: int = 10) -> list[str]:
        """Up to `limit` keys stored under the root (not all: the root may hold anything)."""
        raise NotImplementedError

    def refusal(self, prefix: str) -> str | None:
        """Why an entry under prefix was not listed (a link in a directory); None on object stores."""
        return None

    def map(self, fn, items: list) -> list:
        """fn over items, in order (a remote location keeps several requests in flight)."""
        return [fn(x) for x in items]

    def zarr_store(self, prefix: str, *, read_only: bool):
        """A Zarr v3 store whose keys are under `prefix`."""
        raise NotImplementedError

    def make_durable(self, keys: list[str]) -> None:
        """Written objects survive a power loss once this returns (a no-op where a write already does)."""

    def ensure_root(self) -> None:
        """Create the root if the backend has such a thing; fail in one line if it cannot be written."""

    def check_reachable(self) -> None:
        """Fail in one line when there is nothing to read: no such directory, no such bucket,
        refused credentials, nothing listening at the endpoint."""


class LocalLocation(Location):
    def __init__(self, root: Path, url: str | None = None):
        self.root = Path(root)
        self.url = url or str(root)
        self.refused: dict[str, str] = {}  # key -> why it is not an object (a link, a device), from listing

    def path(self, key: str) -> Path:
        return self.root / key if key else self.root

    def read(self, key: str) -> bytes | None:
        path = self.path(key)
        if path.is_symlink():
            raise PipelineError(f"{path}: is a symbolic link; a cache holds regular files only")
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise PipelineError(f"{path}: is a directory") from None

    def read_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[memoryview]:
        path = self.path(key)
        out = []
        try:
            with open(path, "rb") as fh:
                for start, end in ranges:
                    buffer = bytearray(end - start)
                    if os.preadv(fh.fileno(), [buffer], start) != end - start:
                        raise PipelineError(f"{path}: truncated (wanted bytes {start}..{end})")
                    out.append(memoryview(buffer))
        except FileNotFoundError:
            raise PipelineError(f"{path}: missing") from None
        return out

    def stream(self, key: str) -> Iterator[bytes]:
        with open(self.path(key), "rb") as f:
            while block := f.read(STREAM_BLOCK):
                yield block

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """A hard link of a finished temporary: atomic, and refused when the name exists, on
        every POSIX filesystem including NFS (no flock involved)."""
        path = self.path(key)
        tmp = temporary_for(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_synced(tmp, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            fsync_dir(path.parent)
            return True
        except OSError as e:
            raise PipelineError(f"{path}: write failed ({describe_os_error(e)})") from None
        finally:
            tmp.unlink(missing_ok=True)

    def listing(self, prefix: str = "") -> dict[str, int]:
        """Regular files only: a cache is untrusted input, so a symbolic link (to /dev/zero,
        outside the cache) or any other special entry is never followed nor listed; it is noted
        in `refused` (key -> why) for the shard that holds it to be reported. Temporaries of
        small-file writes (pipeline.files.temporary_for) are not objects."""
        base = self.path(prefix.rstrip("/"))
        found: dict[str, int] = {}
        if base.is_symlink():
            self.refused[prefix.rstrip("/")] = f"{base}: is a symbolic link; a cache holds regular files only"
            return found
        if not base.is_dir():
            return found
        for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
            for name in dirnames + filenames:
                if name in filenames and temporary_target(name) is not None:
                    continue                  # another writer's temporary: it may be renamed away while we look
                path = Path(dirpath) / name
                key = path.relative_to(self.root).as_posix()
                try:
                    info = path.lstat()
                except FileNotFoundError:     # removed by a concurrent writer since the walk listed it
                    continue
                if stat.S_ISLNK(info.st_mode):
                    self.refused[key] = f"{path}: is a symbolic link; a cache holds regular files only"
                elif name in filenames and not stat.S_ISREG(info.st_mode):
                    self.refused[key] = f"{path}: is not a regular file"
                elif name in filenames:
                    found[key] = info.st_size
        return dict(sorted(found.items()))

    def refusal(self, prefix: str) -> str | None:
        """Why something under prefix ('shard-00003/') was not listed, if anything was refused."""
        for key, why in self.refused.items():
            if key == prefix.rstrip("/") or key.startswith(prefix):
                return why
        return None

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self.path(prefix.rstrip("/")), ignore_errors=True)

    def delete(self, key: str) -> None:
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError as e:
            raise PipelineError(f"{self.path(key)}: delete failed ({describe_os_error(e)})") from None

    def some_keys(self, limit: int = 10) -> list[str]:
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            found.append(entry.name + ("/" if entry.is_dir() else ""))
            if len(found) >= limit:
                break
        return found

    def zarr_store(self, prefix: str, *, read_only: bool):
        from zarr.storage import LocalStore
        return LocalStore(self.path(prefix.rstrip("/")), read_only=read_only)

    def make_durable(self, keys: list[str]) -> None:
        """fsync exactly these files and the directories that hold them (deepest first)."""
        directories = set()
        for key in keys:
            path = self.path(key)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            directories.add(path.parent)
        for directory in sorted(directories, key=lambda d: -len(d.parts)):
            fsync_dir(directory)

    def check_reachable(self) -> None:
        if not self.root.is_dir():
            raise PipelineError(f"{self.url}: no such cache directory")

    def ensure_root(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PipelineError(f"{self.root}: cannot create the cache directory ({describe_os_error(e)})") from None
        if not os.access(self.root, os.W_OK):
            raise PipelineError(f"{self.root}: {os.strerror(errno.EACCES).lower()}")
