"""Write one shard: incremental, file-aligned, committed by its record (pipeline/cache/commit.py).

Memory stays bounded by one file per token array (`Chunking.writer_buffer_bytes`, plus 16 bytes
a sample): rows are copied into a file-sized buffer, and each file is written exactly once,
whole, when its buffer is full (Zarr's sharding codec then never reads a file back to update
it), straight into `shard-NNNNN/` of the cache's location (a directory or an object store).
`commit()` writes the per-sample arrays, makes exactly the files written durable, then writes
the commit record `digests.json` last, if absent (size and sha256 of every file, hashed as it
was written: nothing is re-read; and the shard's record), and returns the record. Until that
last write the shard is invisible to every reader; an earlier attempt's files are removed first.

`BackgroundWriter` runs appends on a thread behind a bounded queue, so the forward pass never
waits on compression or the disk unless the queue is full.
"""

from __future__ import annotations

import functools
import queue
import threading
import time

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec

from pipeline.cache.commit import DigestingStore, record_bytes
from pipeline.files import describe_os_error, digest_of_files
from pipeline.cache.location import Location
from pipeline.cache.schema import (DIGESTS, FILE_KEY_SEPARATOR, INPUT_IDS, OFFSETS, SAMPLE_ID, Chunking, array_specs,
                                   inner_shape, shard_name)
from pipeline.errors import PipelineError
from pipeline.faults import failpoint


class AlreadyCommitted(PipelineError):
    """Another writer committed this shard first (its record stands; this attempt's is dropped)."""


def _storage_errors(method):
    """A full disk, a quota, a file-size limit or a store that keeps failing becomes one line
    naming the shard; the partial shard is removed where possible (it is invisible without its
    record, and its space may be what the user needs)."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (AlreadyCommitted, ValueError):
            raise
        except Exception as e:  # noqa: BLE001 - OSError from a disk, obstore's errors from a bucket
            reason = describe_os_error(e) if isinstance(e, OSError) else str(e) if isinstance(e, PipelineError) \
                else store_error(e)
            if reason is None:
                raise
            try:
                self.location.delete_prefix(self.prefix)
            except Exception:  # noqa: BLE001 - the store may be what failed; the next run redoes it
                pass
            raise PipelineError(f"{self.location.where(shard_name(self.index))}: write failed ({reason}); "
                                "the shard is not committed and the cache is consistent: fix the cause, then "
                                "re-run the same command to resume") from None
    return wrapped


def store_error(e: Exception) -> str | None:
    """A one-line reason for an object-store client's error (None: not one of those)."""
    if type(e).__module__.startswith("obstore"):
        from pipeline.cache.object_store import describe_error
        return describe_error(e)
    return None


class ShardWriter:
    @_storage_errors
    def __init__(self, location: Location, index: int, *, dims: dict[str, int], hidden_format: str, num_tokens: int,
                 zstd_level: int = 3, attrs: dict | None = None, chunking: Chunking | None = None):
        """num_tokens: the shard's final token count (the arrays are created at full size once)."""
        self.location, self.index = location, index
        self.prefix = f"{shard_name(index)}/"  # set before anything can fail (see _storage_errors)
        location.delete_prefix(self.prefix)  # a crashed earlier attempt: redo, never append to it
        self.store = DigestingStore(location.zarr_store(self.prefix, read_only=False))
        self.group = zarr.open_group(self.store, mode="w", zarr_format=3)
        self.attrs = dict(attrs or {})  # stored in the shard (its group's zarr.json) and in its record
        # Stored in the commit record only: how this run was laid out and where it ran. Kept out of
        # the shard's files so that the shard's digest depends on its content alone, not on how
        # many nodes or processes wrote the cache (DESIGN 11).
        self.run_record: dict = {}
        self.codecs = [ZstdCodec(level=zstd_level), Crc32cCodec()]
        self.specs = {s.name: s for s in array_specs(hidden_format)}
        self.num_tokens = num_tokens
        chunking = chunking or Chunking()
        self.token_arrays: dict[str, zarr.Array] = {}
        self.buffers: dict[str, np.ndarray] = {}    # one file of tokens per array
        self.filled: dict[str, int] = {}           # tokens in the buffer
        self.written: dict[str, int] = {}          # tokens already in files
        for spec in self.specs.values():
            if spec.per != "token":
                continue
            inner = inner_shape(spec, dims)
            chunk, per_file = chunking.chunk_tokens(spec, dims), chunking.file_tokens(spec, dims)
            self.token_arrays[spec.name] = self._create(spec, (num_tokens, *inner), chunks=(chunk, *inner),
                                                        shards=(per_file, *inner))
            self.buffers[spec.name] = np.empty((min(per_file, num_tokens), *inner), dtype=spec.dtype)
            self.filled[spec.name] = self.written[spec.name] = 0
        self.offsets = [0]
        self.sample_ids: list[int] = []

    def _create(self, spec, shape, **chunking) -> zarr.Array:
        return self.group.create_array(spec.name, shape=shape, dtype=spec.dtype, compressors=self.codecs, fill_value=0,
                                       chunk_key_encoding={"name": "default", "separator": FILE_KEY_SEPARATOR},
                                       # every inner chunk is stored, even an all-zero one
                                       config={"write_empty_chunks": True},
                                       attributes={"per": spec.per, "logical": spec.logical}, **chunking)

    @_storage_errors
    def append(self, sample_id: int, rows: dict[str, np.ndarray]) -> None:
        """Add one sample; `rows` holds every per-token array, all with the same length."""
        lengths = {name: len(rows[name]) for name in self.token_arrays}
        n = lengths[INPUT_IDS]
        if set(lengths.values()) != {n} or n == 0:
            raise ValueError(f"sample {sample_id}: per-token arrays disagree in length or are empty: {lengths}")
        if self.offsets[-1] + n > self.num_tokens:
            raise ValueError(f"{shard_name(self.index)}: more tokens than the {self.num_tokens} announced")
        for name in self.token_arrays:
            values, buffer, done = np.asarray(rows[name]), self.buffers[name], 0
            while done < n:
                take = min(n - done, len(buffer) - self.filled[name])
                buffer[self.filled[name]:self.filled[name] + take] = values[done:done + take]
                self.filled[name] += take
                done += take
                if self.filled[name] == len(buffer):
                    self._write_file(name)
        self.offsets.append(self.offsets[-1] + n)
        self.sample_ids.append(int(sample_id))

    def _write_file(self, name: str) -> None:
        """Write the buffered tokens as one whole file (the last file of an array may be short)."""
        count, start = self.filled[name], self.written[name]
        if count:
            self.token_arrays[name][start:start + count] = self.buffers[name][:count]
            failpoint("writer.chunk")
            self.written[name], self.filled[name] = start + count, 0

    @_storage_errors
    def commit(self) -> dict:
        if not self.sample_ids:
            raise ValueError(f"{shard_name(self.index)}: refusing to commit an empty shard")
        if self.offsets[-1] != self.num_tokens:
            raise ValueError(f"{shard_name(self.index)}: {self.offsets[-1]} tokens written, {self.num_tokens} announced")
        for name in self.token_arrays:
            self._write_file(name)
        self.buffers.clear()
        per_sample = {OFFSETS: self.offsets, SAMPLE_ID: self.sample_ids}
        for spec in self.specs.values():
            if spec.per == "sample":
                values = per_sample[spec.name]
                self._create(spec, (len(values),), chunks=(len(values),))[:] = np.asarray(values, dtype=spec.dtype)
        record = {
            "samples": len(self.sample_ids),
            "tokens": self.offsets[-1],
            "sample_id_min": min(self.sample_ids),
            "sample_id_max": max(self.sample_ids),
            **self.attrs,
        }
        self.group.attrs.update({"shard": shard_name(self.index), **record})
        record.update(self.run_record)
        files = dict(self.store.written)
        synced = time.perf_counter()
        self.location.make_durable([self.prefix + key for key in files])
        self.fsync_seconds = time.perf_counter() - synced  # most of a commit: the disk catching up
        failpoint("writer.fsynced")
        record["bytes"] = sum(size for size, _ in files.values())  # the files the record lists
        record["files"] = len(files) + 1
        record["digest"] = "sha256:" + digest_of_files(files)
        if not self.location.put_if_absent(self.prefix + DIGESTS, record_bytes(files, record)):
            raise AlreadyCommitted(f"{self.location.where(shard_name(self.index))}: committed by another writer "
                                   "meanwhile; its record stands")
        failpoint("writer.committed")  # committed: every reader sees it from now on
        return record


class BackgroundWriter:
    """Runs callables on one thread, behind a queue of at most `depth` pending items. Errors
    surface on the next `submit` or on `close`. depth=0 runs each callable inline instead (the
    right choice when the forward itself runs on every CPU core: see BENCHMARKS.md)."""

    def __init__(self, depth: int = 4):
        self.inline = depth == 0
        self.queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="cache-writer", daemon=True)
        if not self.inline:
            self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if self.error is None:
                try:
                    item()
                except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                    self.error = e

    def submit(self, fn) -> None:
        self._raise()
        if self.inline:
            fn()
        else:
            self.queue.put(fn)

    def close(self) -> None:
        if not self.inline:
            self.queue.put(None)
            self.thread.join()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error
