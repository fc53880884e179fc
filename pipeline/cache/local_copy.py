"""A bounded local disk cache of a remote cache's files (`pipeline train --cache-local DIR`).

Training reads every file of a remote cache once per epoch. With `--cache-local DIR --cache-local-size
BYTES`, the first read of a file downloads it whole into DIR (streamed to a temporary, fsynced,
then renamed: a copy is complete or absent, after a power loss too, since a later run reuses
it), later reads of its byte ranges are local preads, and the least recently used copies are
deleted when the total would pass the size. A file larger than the whole budget is never copied
(read by range as without the cache). Copies are checked against the size in the cache's
listing, and every chunk read from them is still CRC32C-checked by the reader. The directory is
keyed by the cache's URL, so two caches never share copies.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

from pipeline.cache.location import LocalLocation, Location
from pipeline.errors import PipelineError
from pipeline.files import temporary_target, write_atomic


class LocalCopies(Location):
    """A remote location whose range reads go through bounded local copies; writes are refused
    and everything else goes to the remote location itself."""

    remote = True

    def __init__(self, inner: Location, directory: Path, max_bytes: int):
        if max_bytes <= 0:
            raise PipelineError(f"--cache-local-size must be positive, got {max_bytes}")
        self.inner, self.max_bytes, self.url = inner, max_bytes, inner.url
        self.dir = Path(directory) / hashlib.sha256(inner.url.encode()).hexdigest()[:16]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PipelineError(f"{directory}: cannot create the local cache directory ({e.strerror})") from None
        self.local = LocalLocation(self.dir)
        # Copies left by an earlier run count against the budget, oldest first.
        found = [p for p in self.dir.rglob("*") if p.is_file()]
        for p in found:
            if temporary_target(p.name) is not None or ".part-" in p.name:  # (.part-: earlier versions' name)
                p.unlink(missing_ok=True)  # a download that was cut short
        self.copies: OrderedDict[str, int] = OrderedDict(
            (p.relative_to(self.dir).as_posix(), p.stat().st_size)
            for p in sorted((p for p in found if p.exists()), key=lambda p: p.stat().st_mtime))
        self._sizes: dict[str, int] | None = None
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def read_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[memoryview]:
        if self._ensure_copy(key):
            try:
                return self.local.read_ranges(key, ranges)
            except PipelineError:  # evicted meanwhile by another loader process sharing the directory
                with self._lock:
                    self.copies.pop(key, None)
        return self.inner.read_ranges(key, ranges)

    def _ensure_copy(self, key: str) -> bool:
        """Whether a complete local copy of `key` exists (made now if it fits the budget)."""
        with self._lock:
            if self._sizes is None:
                self._sizes = self.inner.listing()
            size = self._sizes.get(key)
            if key in self.copies and self.copies[key] == size:
                self.copies.move_to_end(key)
                self.hits += 1
                return True
            if size is None or size > self.max_bytes:
                return False
            self._evict(self.max_bytes - size)
        path = self.dir / key
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, self._download(key, size))
        except OSError:
            return False  # the local disk is full or gone: read this file remotely instead
        with self._lock:
            self.copies[key] = size
            self.misses += 1
        return True

    def _download(self, key: str, size: int) -> Iterator[bytes]:
        """The remote file's blocks; raising after the last one when they do not add up to the
        listing's size, so that the short copy is never renamed into place."""
        written = 0
        for block in self.inner.stream(key):
            written += len(block)
            yield block
        if written != size:
            raise PipelineError(f"{self.inner.where(key)}: read {written} bytes, the listing says {size}")

    def _evict(self, budget: int) -> None:
        """Delete least recently used copies until they total at most `budget` bytes."""
        total = sum(self.copies.values())
        while self.copies and total > budget:
            key, size = self.copies.popitem(last=False)
            (self.dir / key).unlink(missing_ok=True)
            total -= size

    def where(self, key: str = "") -> str:
        return self.inner.where(key)

    def read(self, key):
        return self.inner.read(key)

    def stream(self, key):
        return self.inner.stream(key)

    def listing(self, prefix: str = ""):
        return self.inner.listing(prefix)

    def some_keys(self, limit: int = 10):
        return self.inner.some_keys(limit)

    def zarr_store(self, prefix: str, *, read_only: bool):
        return self.inner.zarr_store(prefix, read_only=read_only)

    def map(self, fn, items):
        return self.inner.map(fn, items)

    def check_reachable(self) -> None:
        self.inner.check_reachable()

    def put_if_absent(self, key, data):
        raise PipelineError(f"{self.where(key)}: a cache read through --cache-local is read-only")

    def delete_prefix(self, prefix):
        raise PipelineError(f"{self.where(prefix)}: a cache read through --cache-local is read-only")
