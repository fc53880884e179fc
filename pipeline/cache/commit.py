"""The commit protocol (DESIGN 11): a shard is committed if and only if its commit record exists
and matches its files. No rename, no lock: it holds on an object store and on a shared
filesystem whose `flock` does not work.

A shard's writer writes every file whole (Zarr hands each complete file to the store once:
`DigestingStore` hashes it on the way, so nothing is re-read), makes them durable, and writes the
commit record last: `shard-NNNNN/digests.json` with the size and sha256 of every other file of
the shard and the shard's record (counts, digest, identity, provenance), created only if absent.
Readers derive the list of committed shards from the records (`committed_shards`); a shard
directory without a record, or whose files are not the record's sizes, is a partial write:
invisible, redone by the next extract. A file that no record lists is never read.

Caches written before this protocol list their shards in manifest.json and keep a digests.json
of files only; they stay readable (see pipeline/cache/manifest.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from zarr.storage import WrapperStore

from pipeline.cache.location import Location
from pipeline.cache.schema import DIGESTS, shard_index
from pipeline.errors import PipelineError

FileDigests = dict[str, tuple[int, str]]  # path relative to the shard -> (size, sha256 hex)
PROTOCOL = "commit records: shard-NNNNN/digests.json, written last and only if absent, lists every file"
# Stated in manifest.json, so whoever opens a cache finds each shard's provenance without this tool.
SHARD_RECORDS = ("shard-NNNNN/digests.json, key 'shard': counts, samples, tokens, bytes, the shard's identity, "
                 "kernel provenance per linear-attention op, host, environment, parallel layout")
_SHARD_NAME = re.compile(r"^shard-\d{5}$")
_RECORD_KEY = re.compile(r"^(shard-\d{5})/" + re.escape(DIGESTS) + "$")


def record_bytes(files: FileDigests, shard: dict | None) -> bytes:
    """The commit record's bytes (a legacy record, `shard` None, lists the files only)."""
    listing: dict[str, Any] = {"files": {rel: {"bytes": size, "sha256": sha} for rel, (size, sha) in sorted(files.items())}}
    if shard is not None:
        listing["shard"] = shard
    return (json.dumps(listing, indent=1, sort_keys=True) + "\n").encode()


def parse_record(raw: bytes, where: str) -> tuple[FileDigests, dict | None]:
    """(files, shard record or None) of a digests.json; errors name the file."""
    try:
        listing = json.loads(raw.decode("utf-8"))
        files = {str(rel): (int(entry["bytes"]), str(entry["sha256"])) for rel, entry in listing["files"].items()}
        shard = listing.get("shard")
        if shard is not None and not isinstance(shard, dict):
            raise TypeError("'shard' is not a mapping")
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise PipelineError(f"{where}: unreadable commit record ({type(e).__name__}: {e})") from None
    for rel in files:
        if rel.startswith("/") or ".." in rel.split("/") or rel == DIGESTS:
            raise PipelineError(f"{where}: commit record lists an invalid file name {rel!r}")
    return files, shard


def read_digests(location: Location, name: str) -> FileDigests:
    """What the writer recorded in the shard's digests.json."""
    key = f"{name}/{DIGESTS}"
    raw = location.read(key)
    if raw is None:
        raise PipelineError(f"{location.where(key)}: missing")
    return parse_record(raw, location.where(key))[0]


def hash_shard(location: Location, name: str, files: dict[str, int] | None = None) -> FileDigests:
    """Every file of a shard but digests.json, re-hashed streaming from where it lives (no local
    copy of a remote cache). `files`: the shard's {relative path: size}, when the caller has it."""
    prefix = f"{name}/"
    if files is None:
        files = {k[len(prefix):]: v for k, v in location.listing(prefix).items()}

    def one(rel: str) -> tuple[str, tuple[int, str]]:
        h, size = hashlib.sha256(), 0
        for block in location.stream(prefix + rel):
            h.update(block)
            size += len(block)
        return rel, (size, h.hexdigest())

    return dict(location.map(one, [rel for rel in files if rel != DIGESTS]))


def mismatch(files: FileDigests, present: dict[str, int]) -> str | None:
    """Why the files under a shard (relative path -> size) are not the ones its record lists."""
    for rel, (size, _) in sorted(files.items()):
        if rel not in present:
            return f"{rel} is listed but missing"
        if present[rel] != size:
            return f"{rel} is {present[rel]} bytes, the record says {size}"
    return None


def committed_shards(location: Location, listing: dict[str, int]) -> tuple[dict[str, dict], dict[str, str]]:
    """({name: shard record} of the committed shards, {name: why not} of shards whose record is
    there but does not match), from a listing of the whole cache. Legacy records (files only)
    are neither: those shards are listed in manifest.json."""
    names = sorted(m.group(1) for key in listing if (m := _RECORD_KEY.match(key)))
    present: dict[str, dict[str, int]] = {name: {} for name in names}
    for key, size in listing.items():
        head, _, rel = key.partition("/")
        if head in present:
            present[head][rel] = size
    raws = location.map(lambda n: location.read(f"{n}/{DIGESTS}"), names)
    committed, broken = {}, {}
    for name, raw in zip(names, raws):
        where = location.where(f"{name}/{DIGESTS}")
        if raw is None:
            continue  # removed between the listing and the read: a redo in progress
        try:
            files, shard = parse_record(raw, where)
        except PipelineError as e:
            broken[name] = str(e)
            continue
        if shard is None:
            continue
        why = location.refusal(f"{name}/") or mismatch(files, present[name])
        if why:
            broken[name] = f"{name}: its commit record does not match its files ({why})"
        else:
            committed[name] = shard
    for key, why in getattr(location, "refused", {}).items():
        name = key.split("/", 1)[0]  # a link where a shard or one of its files should be
        if _SHARD_NAME.match(name) and name not in committed:
            broken.setdefault(name, why)
    return committed, broken


def shard_committed(location: Location, name: str) -> bool:
    """Whether one shard is committed (its record exists and matches): the check a writer makes
    before redoing a shard, without listing the whole cache."""
    shard_index(name)
    raw = location.read(f"{name}/{DIGESTS}")
    if raw is None:
        return False
    try:
        files, shard = parse_record(raw, location.where(f"{name}/{DIGESTS}"))
    except PipelineError:
        return False
    if shard is None:
        return False
    prefix = f"{name}/"
    present = {k[len(prefix):]: v for k, v in location.listing(prefix).items()}
    return mismatch(files, present) is None


class DigestingStore(WrapperStore):
    """A Zarr store that records the size and sha256 of every object written through it."""

    def __init__(self, store):
        super().__init__(store)
        self.written: FileDigests = {}  # key -> (bytes, sha256 hex) of its last write

    def _record(self, key: str, value) -> None:
        view = memoryview(value.as_buffer_like()).cast("B")
        self.written[key] = (view.nbytes, hashlib.sha256(view).hexdigest())

    async def set(self, key, value) -> None:
        await self._store.set(key, value)
        self._record(key, value)

    async def set_if_not_exists(self, key, value) -> None:
        await self._store.set_if_not_exists(key, value)
        self._record(key, value)

    async def delete(self, key) -> None:
        self.written.pop(key, None)
        await self._store.delete(key)
