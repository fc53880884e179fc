"""A Zarr store that remembers the size and sha256 of every file it writes.

The shard writer commits without re-reading what it wrote (issue 15): Zarr hands each file's
complete bytes to the store once (a whole sharded file, an array's zarr.json), so hashing them
on the way to the disk gives the per-file digests, and the set of keys is exactly the files to
fsync before the shard's rename.
"""

from __future__ import annotations

import hashlib

from zarr.storage import LocalStore


class DigestingStore(LocalStore):
    def __init__(self, root, **kwargs):
        super().__init__(root, **kwargs)
        self.written: dict[str, tuple[int, str]] = {}  # key -> (bytes, sha256 hex) of its last write

    def _record(self, key: str, value) -> None:
        view = memoryview(value.as_buffer_like()).cast("B")
        self.written[key] = (view.nbytes, hashlib.sha256(view).hexdigest())

    async def _set(self, key, value, exclusive: bool = False) -> None:
        await super()._set(key, value, exclusive)
        self._record(key, value)

    def set_sync(self, key, value) -> None:
        super().set_sync(key, value)
        self._record(key, value)

    async def delete(self, key) -> None:
        self.written.pop(key, None)
        await super().delete(key)

    def delete_sync(self, key) -> None:
        self.written.pop(key, None)
        super().delete_sync(key)
