"""Write one shard: incremental, chunk-aligned, committed atomically.

Memory stays bounded by one chunk per array (plus per-sample offsets): rows are buffered until a
whole chunk is ready, and each chunk is written exactly once. `commit()` writes the per-sample
arrays and the shard record, fsyncs everything, renames `.shard-NNNNN.tmp` to `shard-NNNNN`
and returns the record the manifest will list. Until then nothing looks complete.

`BackgroundWriter` runs appends on a thread behind a bounded queue, so the forward pass never
waits on compression or the disk unless the queue is full.
"""

from __future__ import annotations

import functools
import os
import queue
import shutil
import threading
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec

from pipeline.cache.files import describe_os_error, fsync_dir, fsync_tree, tree_bytes, tree_digest
from pipeline.cache.schema import array_specs, chunk_tokens, inner_shape, shard_name, temp_shard_name
from pipeline.errors import PipelineError
from pipeline.faults import failpoint


def _storage_errors(method):
    """A full disk, a quota or a file-size limit becomes one line naming the shard; the partial
    shard is removed (it could never be listed, and its space may be what the user needs)."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except OSError as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise PipelineError(f"{self.cache_dir / shard_name(self.index)}: write failed ({describe_os_error(e)}); "
                                "the shard is not committed and the cache is consistent: make room, then re-run "
                                "the same command to resume") from None
    return wrapped


class ShardWriter:
    @_storage_errors
    def __init__(self, cache_dir: Path, index: int, *, dims: dict[str, int], hidden_format: str,
                 zstd_level: int = 3, attrs: dict | None = None, num_tokens: int | None = None):
        """num_tokens: the shard's final token count when known up front; the arrays are then
        created at full size and never resized (half the metadata writes)."""
        self.cache_dir = Path(cache_dir)
        self.index = index
        self.tmp = self.cache_dir / temp_shard_name(index)  # set before anything can fail (see _storage_errors)
        if self.tmp.exists():
            shutil.rmtree(self.tmp)  # a crashed earlier attempt: redo, never append to it
        self.group = zarr.open_group(str(self.tmp), mode="w", zarr_format=3)
        self.attrs = dict(attrs or {})
        codecs = [ZstdCodec(level=zstd_level), Crc32cCodec()]
        self.token_arrays, self.chunk = {}, {}
        self.buffers: dict[str, list[np.ndarray]] = {}
        self.buffered: dict[str, int] = {}
        self.written: dict[str, int] = {}
        self.specs = {s.name: s for s in array_specs(hidden_format)}
        self.num_tokens = num_tokens
        for spec in self.specs.values():
            inner = inner_shape(spec, dims)
            n = chunk_tokens(spec, dims) if spec.per == "token" else 1 << 16
            length = num_tokens if (num_tokens is not None and spec.per == "token") else 0
            arr = self.group.create_array(spec.name, shape=(length, *inner), chunks=(n, *inner), dtype=spec.dtype,
                                          compressors=codecs, fill_value=0,
                                          # every chunk gets a file (even all-zero ones), so a
                                          # missing file is damage, never a silent fill value
                                          config={"write_empty_chunks": True},
                                          attributes={"per": spec.per, "logical": spec.logical})
            if spec.per == "token":
                self.token_arrays[spec.name], self.chunk[spec.name] = arr, n
                self.buffers[spec.name], self.buffered[spec.name], self.written[spec.name] = [], 0, 0
        self.offsets = [0]
        self.sample_ids: list[int] = []

    @_storage_errors
    def append(self, sample_id: int, rows: dict[str, np.ndarray]) -> None:
        """Add one sample; `rows` holds every per-token array, all with the same length."""
        lengths = {name: len(rows[name]) for name in self.token_arrays}
        n = lengths["input_ids"]
        if set(lengths.values()) != {n} or n == 0:
            raise ValueError(f"sample {sample_id}: per-token arrays disagree in length or are empty: {lengths}")
        for name in self.token_arrays:
            self.buffers[name].append(np.asarray(rows[name], dtype=self.specs[name].dtype))
            self.buffered[name] += n
            if self.buffered[name] >= self.chunk[name]:
                self._flush(name, final=False)
        self.offsets.append(self.offsets[-1] + n)
        self.sample_ids.append(int(sample_id))

    def _flush(self, name: str, *, final: bool) -> None:
        data = np.concatenate(self.buffers[name]) if self.buffers[name] else None
        if data is None:
            return
        chunk = self.chunk[name]
        take = len(data) if final else (len(data) // chunk) * chunk
        if take == 0:
            return
        arr, start = self.token_arrays[name], self.written[name]
        if self.num_tokens is None:
            arr.resize((start + take, *arr.shape[1:]))
        elif start + take > self.num_tokens:
            raise ValueError(f"{shard_name(self.index)}: more tokens than the {self.num_tokens} announced")
        arr[start:start + take] = data[:take]
        failpoint("writer.chunk")
        self.written[name] = start + take
        rest = data[take:]
        self.buffers[name] = [rest] if len(rest) else []
        self.buffered[name] = len(rest)

    @_storage_errors
    def commit(self) -> dict:
        if not self.sample_ids:
            raise ValueError(f"{shard_name(self.index)}: refusing to commit an empty shard")
        for name in self.token_arrays:
            self._flush(name, final=True)
        if self.num_tokens is not None and self.offsets[-1] != self.num_tokens:
            raise ValueError(f"{shard_name(self.index)}: {self.offsets[-1]} tokens written, {self.num_tokens} announced")
        for name, values in (("offsets", self.offsets), ("sample_id", self.sample_ids)):
            arr = self.group[name]
            arr.resize((len(values),))
            arr[:] = np.asarray(values, dtype=self.specs[name].dtype)
        record = {
            "samples": len(self.sample_ids),
            "tokens": self.offsets[-1],
            "sample_id_min": min(self.sample_ids),
            "sample_id_max": max(self.sample_ids),
            **self.attrs,
        }
        self.group.attrs.update({"shard": shard_name(self.index), **record})
        fsync_tree(self.tmp)
        failpoint("writer.fsynced")
        record["bytes"] = tree_bytes(self.tmp)
        record["digest"] = "sha256:" + tree_digest(self.tmp)
        final = self.cache_dir / shard_name(self.index)
        if final.exists():
            shutil.rmtree(final)  # an unlisted leftover of a run that died before the manifest update
        os.replace(self.tmp, final)
        fsync_dir(self.cache_dir)
        failpoint("writer.renamed")  # committed on disk, not yet listed in the manifest
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
