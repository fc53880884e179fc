"""A shard's file digests: hashed while writing, kept in digests.json, re-hashed by verify.

The shard writer commits without re-reading what it wrote (issue 15): Zarr hands each file's
complete bytes to the store once (a whole sharded file, an array's zarr.json), so
`DigestingStore` hashing them on the way to the disk gives the per-file digests, and the set of
keys is exactly the files to fsync before the shard's rename. `write_digests` / `read_digests`
own the format of digests.json; `hash_shard` recomputes the same from disk.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from zarr.storage import LocalStore

from pipeline.cache.files import hash_files, regular_files
from pipeline.cache.schema import DIGESTS
from pipeline.errors import PipelineError

FileDigests = dict[str, tuple[int, str]]  # relative path -> (size, sha256 hex)


def write_digests(shard_dir: Path, files: FileDigests) -> Path:
    path = shard_dir / DIGESTS
    listing = {"files": {rel: {"bytes": size, "sha256": sha} for rel, (size, sha) in sorted(files.items())}}
    path.write_text(json.dumps(listing, indent=1) + "\n", encoding="utf-8")
    return path


def read_digests(shard_dir: Path) -> FileDigests:
    """What the writer recorded in the shard's digests.json."""
    path = shard_dir / DIGESTS
    try:
        listing = json.loads(path.read_text(encoding="utf-8"))["files"]
        return {str(rel): (int(entry["bytes"]), str(entry["sha256"])) for rel, entry in listing.items()}
    except FileNotFoundError:
        raise PipelineError(f"{path}: missing") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise PipelineError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def hash_shard(shard_dir: Path, files: list[Path] | None = None) -> FileDigests:
    """Every file of a shard but digests.json, hashed from disk (`files`: the shard's
    `regular_files` listing when the caller has it already)."""
    listing = regular_files(shard_dir) if files is None else files
    return hash_files(shard_dir, [f for f in listing if f != shard_dir / DIGESTS])


class DigestingStore(LocalStore):
    def __init__(self, root, **kwargs):
        super().__init__(root, **kwargs)
        self.written: FileDigests = {}  # key -> (bytes, sha256 hex) of its last write

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
