"""Read a cache: the manifest, committed shards, one sample's positions without decoding the shard.

The cache lives wherever its location says (a directory or an object store: pipeline/cache/
location.py); it is listed once per reader. Only committed shards are visible, and only the
files their records list are read. Per-sample arrays (offsets, sample_id) are read
once per shard (16 bytes a sample); token arrays are read by range through `ShardedArray`, which
decodes only the inner chunks that overlap it and verifies each one's CRC32C.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import zarr

from pipeline.cache.encoding import decode_hidden
from pipeline.cache.local_copy import LocalCopies
from pipeline.cache.address import open_location
from pipeline.cache.location import Location
from pipeline.cache.manifest import describe_foreign, read_manifest
from pipeline.cache.schema import (HARD_LABEL, HIDDEN, OFFSETS, SAMPLE_ID, SAMPLE_TOKENS, SOFT_LABEL, array_specs,
                                   file_key, role_names, shard_name)
from pipeline.cache.sharded import ChunkCache, ShardedArray
from pipeline.config import parse_size
from pipeline.errors import PipelineError


def expected_files(array, name: str) -> list[str]:
    """Relative paths of the data files an array of this shape and chunking has."""
    per_file = (getattr(array, "shards", None) or array.chunks)[0]
    return [file_key(name, i, array.ndim) for i in range(-(-array.shape[0] // per_file))]


class ShardReader:
    def __init__(self, location: Location, name: str, hidden_format: str, *, files: dict[str, int],
                 chunk_cache_bytes: int = 0, expected: tuple[int, int] | None = None):
        """`files`: {path relative to the shard: size} of its files, from the cache's listing.
        `chunk_cache_bytes` > 0 keeps that many bytes of decoded inner chunks that a read
        covered only partly (least recently used dropped first): a shuffled pass over a shard
        then decodes (and CRC-checks) a chunk shared by neighbouring samples once, not once per
        sample. Chunks a read covers whole are decoded straight into its output."""
        self.location, self.name = location, name
        self.path = location.where(name)  # for messages
        self.hidden_format = hidden_format
        self.files = files
        self.cache = ChunkCache(chunk_cache_bytes) if chunk_cache_bytes else None
        self._arrays: dict = {}
        self._sharded: dict[str, ShardedArray] = {}
        try:
            self.group = zarr.open_group(location.zarr_store(name, read_only=True), mode="r", zarr_format=3)
            if expected is not None:
                self._check_declared_shapes(*expected)
            self._check_files(set(files))
            self.offsets = self.group[OFFSETS][:]
            self.sample_ids = self.group[SAMPLE_ID][:]
        except PipelineError:
            raise
        except Exception as e:  # noqa: BLE001 - zarr raises many types; the message names the shard
            raise PipelineError(f"{self.path}: cannot open shard ({type(e).__name__}: {e})") from None
        self.row_of = {int(s): i for i, s in enumerate(self.sample_ids)}

    def _check_declared_shapes(self, samples, tokens) -> None:
        """Shapes a shard's metadata declares must match the manifest's counts before anything is
        read: a shard is untrusted input, and a declared petabyte array must not be allocated."""
        if not isinstance(samples, int) or not isinstance(tokens, int):
            raise PipelineError(f"{self.path}: the manifest has no sample/token counts for this shard")
        for spec, array in self._schema_arrays():
            first = array.shape[0] if array.shape else None
            if first != spec.length(samples=samples, tokens=tokens):
                raise PipelineError(f"{self.path}/{spec.name}: declares shape {tuple(array.shape)}, but the manifest "
                                    f"says {samples} samples and {tokens} tokens")

    def _schema_arrays(self):
        """(spec, array) of every array the schema defines for this format; a missing one is an error."""
        for spec in array_specs(self.hidden_format):
            try:
                yield spec, self.array(spec.name)
            except KeyError:
                raise PipelineError(f"{self.path}/{spec.name}: array missing") from None

    def _check_files(self, present: set[str]) -> None:
        """Every data file the arrays' shapes imply is on disk: Zarr would read a missing file as
        zeros, so a missing file is named here instead."""
        for spec, array in self._schema_arrays():
            wanted = expected_files(array, spec.name)
            missing = [i for i, key in enumerate(wanted) if key not in present]
            if missing:
                raise PipelineError(f"{self.path}/{spec.name}: chunk file(s) {missing[:5]} missing of {len(wanted)}")

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def span(self, sample_id: int, start: int = 0, stop: int | None = None) -> tuple[int, int]:
        row = self.row_of.get(int(sample_id))
        if row is None:
            raise PipelineError(f"{self.path}: no sample {sample_id}")
        lo, hi = int(self.offsets[row]), int(self.offsets[row + 1])
        stop = hi - lo if stop is None else min(stop, hi - lo)
        return lo + start, lo + stop

    def read(self, name: str, sample_id: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        a, b = self.span(sample_id, start, stop)
        try:
            return self.read_range(name, a, b)
        except PipelineError as e:
            raise PipelineError(f"{self.path}/{name}: read of sample {sample_id} failed ({e})") from None

    def array(self, name: str):
        """The opened Zarr array (opening one re-reads its metadata, so it is done once)."""
        if name not in self._arrays:
            self._arrays[name] = self.group[name]
        return self._arrays[name]

    def sharded(self, name: str) -> ShardedArray:
        """A token array's direct reader (see pipeline/cache/sharded.py)."""
        if name not in self._sharded:
            self._sharded[name] = ShardedArray(self.array(name), self.location, self.name, name, self.files,
                                               self.cache)
        return self._sharded[name]

    def read_range(self, name: str, a: int, b: int) -> np.ndarray:
        """Token (or sample) range [a, b) of one array, by global position inside the shard."""
        try:
            sharded = self._sharded.get(name)
            if sharded is None and self.array(name).attrs.get("per") == "token":
                sharded = self.sharded(name)
            return sharded.read(a, b) if sharded is not None else self.array(name)[a:b]
        except PipelineError:
            raise
        except Exception as e:  # noqa: BLE001
            raise PipelineError(f"{self.path}/{name}[{a}:{b}]: read failed ({type(e).__name__}: {e})") from None

    def hidden(self, sample_id: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Decoded taps [tokens, n_taps, H] (bfloat16 for bf16 caches, float32 for fp8)."""
        return decode_hidden(self.hidden_format, lambda name: self.read(name, sample_id, start, stop))

    def hidden_range(self, a: int, b: int, tap: int) -> torch.Tensor:
        """One tap decoded to float32 [b - a, H] over token range [a, b) of the shard (the other
        taps are read but never decoded): what a check over many samples at once needs."""
        return decode_hidden(self.hidden_format, lambda name: self.read_range(name, a, b)[:, tap]).float()

    def sample(self, sample_id: int) -> dict:
        """Every array of one sample, hidden states decoded."""
        out = {name: self.read(name, sample_id) for name in role_names(SAMPLE_TOKENS, HARD_LABEL, SOFT_LABEL)}
        out[HIDDEN] = self.hidden(sample_id)
        return out


class CacheReader:
    def __init__(self, cache: str | Path | Location, *, foreign: str = "refuse"):
        """`foreign`: what to do with committed shards whose recorded identity differs from the
        manifest's (`Manifest.foreign_shards`): "refuse" (every reader for training and evaluation:
        one line naming the shard, the field and both values; no option trains on a mixed cache)
        or "report" (verify-cache and --show, which name them)."""
        self.location = cache if isinstance(cache, Location) else open_location(cache)
        self.dir = self.location.where()  # for messages
        self.listing = self.location.listing()  # every file with its size, listed once
        manifest = read_manifest(self.location, self.listing)
        if manifest is None:
            raise PipelineError(f"{self.dir}: no manifest.json (not a cache, or no shard committed yet)")
        self.manifest = manifest  # validated on read (declared sizes bounded, chunking parsed)
        self.foreign = manifest.foreign_shards()
        if self.foreign and foreign == "refuse":
            raise PipelineError(describe_foreign(self.dir, self.foreign, len(manifest.shards)))
        self.chunking = manifest.identity.capture.chunking()
        self.hidden_format = manifest.identity.capture.hidden_format
        self.shards = manifest.committed()
        self._by_shard: dict[str, dict[str, int]] = {}
        for key, size in self.listing.items():
            head, _, rel = key.partition("/")
            if rel:
                self._by_shard.setdefault(head, {})[rel] = size

    def files(self, name: str) -> dict[str, int]:
        """{path relative to the shard: size} of every file of a shard (links and special files
        are refused when a directory is listed)."""
        return self._by_shard.get(name, {})

    def present(self, name: str) -> bool:
        """Whether the shard has any file at all."""
        return bool(self.files(name))

    def shard(self, name_or_index: str | int, *, chunk_cache_bytes: int = 0) -> ShardReader:
        name = shard_name(name_or_index) if isinstance(name_or_index, int) else name_or_index
        refused = self.location.refusal(f"{name}/")
        if refused:
            raise PipelineError(refused)
        if name in self.manifest.broken:
            raise PipelineError(f"{self.dir}: {name} is not committed: {self.manifest.broken[name]}")
        if name not in self.manifest.shards:
            raise PipelineError(f"{self.dir}: {name} is not a committed shard")
        record = self.manifest.shards[name]
        return ShardReader(self.location, name, self.hidden_format, files=self.files(name),
                           chunk_cache_bytes=chunk_cache_bytes, expected=(record.samples, record.tokens))

    def find(self, sample_id: int) -> ShardReader:
        for name in self.shards:
            rec = self.manifest.shards[name]
            if rec.sample_id_min <= sample_id <= rec.sample_id_max:
                reader = self.shard(name)
                if sample_id in reader.row_of:
                    return reader
        raise PipelineError(f"{self.dir}: sample {sample_id} is in no committed shard")

    def sample_ids(self) -> list[int]:
        ids: list[int] = []
        for name in self.shards:
            ids += [int(s) for s in self.shard(name).sample_ids]
        return sorted(ids)


def open_cache(cache: str | Path, local: str | Path | None = None, local_size: str | int | None = None, *,
               foreign: str = "refuse") -> CacheReader:
    """A reader of the cache at `cache`, once its location is known to be reachable (so an
    unreachable one is named as such, not as a cache without a manifest); a remote cache read
    through bounded local copies in `local` (of at most `local_size`) with --cache-local.
    `foreign`: see `CacheReader`."""
    location = open_location(cache)
    location.check_reachable()
    if local is None:
        return CacheReader(location, foreign=foreign)
    if not location.remote:
        raise PipelineError(f"--cache-local: {cache} is already on this machine's filesystem")
    return CacheReader(LocalCopies(location, Path(local), parse_size(local_size)), foreign=foreign)
