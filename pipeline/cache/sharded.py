"""Decode token ranges straight from Zarr v3 sharded files: the trainer's read path.

Zarr reads a sharded array correctly, but spends about as long scheduling each inner chunk on
its event loop and thread pool as zstd spends decoding it (BENCHMARKS.md, issue 15: 0.53-0.70
GB/s of CPU time per core against zstd's 1.4). The format is public and small (Zarr v3
`sharding_indexed`: an index of (offset, nbytes) pairs per inner chunk, CRC32C-checked, at the
end of the file; each inner chunk a zstd frame followed by its CRC32C), so this module reads it
directly: one pread per inner chunk from a directory (into a reused buffer), or one coalesced
range request per file from an object store (`Location.read_ranges`: adjacent chunks become one
request), a CRC32C and one zstd call per inner chunk, decoded in place into the output. Only the exact codec chain the writer uses is accepted; anything else is
refused, never guessed. tests/cache/test_cache_layout.py checks it against Zarr's own reader.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import google_crc32c
import numpy as np
from numcodecs import Zstd
from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec, ShardingCodecIndexLocation, ZstdCodec

from pipeline.cache.location import LocalLocation, Location
from pipeline.cache.schema import file_key
from pipeline.errors import PipelineError

_EMPTY = 2**64 - 1  # index entry of an inner chunk that was never written (read as the fill value)
_ZSTD_MAGIC = 0xFD2FB528


def frame_content_size(frame) -> int | None:
    """Decompressed size declared in a zstd frame header (RFC 8878 section 3.1.1.1), or None."""
    if len(frame) < 6 or int.from_bytes(frame[:4], "little") != _ZSTD_MAGIC:
        return None
    descriptor = frame[4]
    fcs_flag, single_segment, dict_flag = descriptor >> 6, (descriptor >> 5) & 1, descriptor & 3
    pos = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[dict_flag]
    width = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    if width == 0 or len(frame) < pos + width:
        return None
    value = int.from_bytes(frame[pos:pos + width], "little")
    return value + 256 if width == 2 else value


class ChunkCache:
    """Decoded inner chunks, least recently used dropped first once over `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.chunks: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self.bytes = 0

    def get(self, key) -> np.ndarray | None:
        chunk = self.chunks.get(key)
        if chunk is not None:
            self.chunks.move_to_end(key)
        return chunk

    def put(self, key, chunk: np.ndarray) -> None:
        self.chunks[key] = chunk
        self.bytes += chunk.nbytes
        while self.bytes > self.max_bytes and len(self.chunks) > 1:
            self.bytes -= self.chunks.popitem(last=False)[1].nbytes


class ShardedArray:
    """Token ranges [a, b) of one array stored with the sharding codec, decoded without Zarr."""

    def __init__(self, array, location: Location, shard: str, name: str, files: dict[str, int],
                 cache: ChunkCache | None = None):
        """`files`: {path relative to the shard: size}, from the cache's listing."""
        self.location, self.shard, self.name, self.files, self.cache = location, shard, name, files, cache
        self.local = isinstance(location, LocalLocation)
        directory = location.where(f"{shard}/{name}")
        codecs = array.metadata.codecs
        sharding = codecs[0] if len(codecs) == 1 and isinstance(codecs[0], ShardingCodec) else None
        inner = [type(c) for c in sharding.codecs] if sharding else []
        index = [type(c) for c in sharding.index_codecs] if sharding else []
        if (sharding is None or inner != [BytesCodec, ZstdCodec, Crc32cCodec] or index != [BytesCodec, Crc32cCodec]
                or sharding.index_location != ShardingCodecIndexLocation.end
                or any(getattr(c.endian, "value", None) not in (None, "little")
                       for c in (sharding.codecs[0], sharding.index_codecs[0]))):
            raise PipelineError(f"{directory}: not stored as this tool writes token arrays "
                                f"(sharding_indexed with bytes, zstd, crc32c); codecs: {codecs}")
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype).newbyteorder("<")
        self.fill_value = array.metadata.fill_value
        self.chunk_tokens, self.file_tokens = array.chunks[0], array.shards[0]
        if tuple(array.chunks[1:]) != self.shape[1:] or self.file_tokens % self.chunk_tokens:
            raise PipelineError(f"{directory}: chunks {array.chunks} in files {array.shards} do not tile "
                                f"whole tokens of shape {self.shape}")
        self.per_file = self.file_tokens // self.chunk_tokens
        self.chunk_shape = (self.chunk_tokens, *self.shape[1:])
        self.chunk_bytes = int(np.prod(self.chunk_shape)) * self.dtype.itemsize
        self.ndim = len(self.shape)
        self._index: dict[int, tuple[str, np.ndarray]] = {}
        self._zstd = Zstd()
        self._scratch = bytearray(0)

    def file_key(self, f: int) -> str:
        """File f's key relative to the shard."""
        return file_key(self.name, f, self.ndim)

    def _file_index(self, f: int) -> tuple[str, np.ndarray]:
        """(key, [per_file, 2] offsets and sizes) of file f, read and checked once."""
        if f not in self._index:
            rel = self.file_key(f)
            key, where = f"{self.shard}/{rel}", self.location.where(f"{self.shard}/{rel}")
            index_bytes = self.per_file * 16 + 4
            size = self.files.get(rel)
            if size is None:
                raise PipelineError(f"{where}: missing")
            if size < index_bytes:
                raise PipelineError(f"{where}: {size} bytes, shorter than its index ({index_bytes})")
            (raw,) = self.location.read_ranges(key, [(size - index_bytes, size)])
            raw = bytes(raw)
            body = np.frombuffer(raw, dtype=np.uint8)[:-4]
            if google_crc32c.value(body) != int.from_bytes(raw[-4:], "little"):
                raise PipelineError(f"{where}: index CRC32C mismatch")
            index = body.view("<u8").reshape(self.per_file, 2)
            written = index[:, 0] != _EMPTY
            offsets, sizes = index[written, 0], index[written, 1]
            data_end = size - index_bytes  # compared before adding, so no uint64 sum can wrap around
            if np.any(offsets > data_end) or np.any(sizes > data_end - offsets) or np.any(sizes < 4):
                raise PipelineError(f"{where}: index points outside the file's data")
            self._index[f] = (key, index)
        return self._index[f]

    def read(self, a: int, b: int) -> np.ndarray:
        a, b = max(a, 0), min(b, self.shape[0])
        out = np.empty((max(b - a, 0), *self.shape[1:]), dtype=self.dtype)
        if b <= a:
            return out
        first, last = a // self.chunk_tokens, (b - 1) // self.chunk_tokens
        for f in range(first // self.per_file, last // self.per_file + 1):
            chunks = range(max(first, f * self.per_file), min(last, (f + 1) * self.per_file - 1) + 1)
            self._read_file(f, chunks, a, b, out)
        return out

    def _read_file(self, f: int, chunks: range, a: int, b: int, out: np.ndarray) -> None:
        """Decode `chunks` (global inner-chunk indices, all in file f) into out (tokens a..b)."""
        todo = []
        for c in chunks:
            # Only a chunk the range covers partly can be wanted again (by the neighbouring
            # sample), so only those go through the cache; the others decode straight into out.
            partial = c * self.chunk_tokens < a or (c + 1) * self.chunk_tokens > b
            cached = self.cache.get((self.name, c)) if self.cache is not None and partial else None
            if cached is not None:
                self._place(cached, c, a, b, out)
            else:
                todo.append(c)
        if not todo:
            return
        key, index = self._file_index(f)
        where = self.location.where(key)
        spans = [tuple(int(v) for v in index[c - f * self.per_file]) for c in todo]
        for c, (offset, nbytes), encoded in zip(todo, spans, self._encoded(key, spans)):
            lo, hi = c * self.chunk_tokens, (c + 1) * self.chunk_tokens
            whole = a <= lo and hi <= b
            target = out[lo - a:hi - a] if whole else np.empty(self.chunk_shape, dtype=self.dtype)
            if offset == _EMPTY:
                target[...] = self.fill_value
            else:
                self._decode(where, c, encoded, target)
            if not whole:
                if self.cache is not None:
                    self.cache.put((self.name, c), target)
                self._place(target, c, a, b, out)

    def _encoded(self, key: str, spans: list[tuple[int, int]]):
        """Each chunk's stored bytes, in order (None for a never-written chunk). From a directory:
        one pread each into a reused buffer (valid until the next one). Remote: all of them in
        one call, which coalesces adjacent ranges into one request."""
        wanted = [(o, o + n) for o, n in spans if o != _EMPTY]
        if not self.local:
            parts = iter(self.location.read_ranges(key, wanted))
            for offset, _ in spans:
                yield None if offset == _EMPTY else np.frombuffer(next(parts), dtype=np.uint8)
            return
        try:
            fh = open(self.location.path(key), "rb")
        except FileNotFoundError:
            raise PipelineError(f"{self.location.where(key)}: missing") from None
        with fh:
            for offset, nbytes in spans:
                yield None if offset == _EMPTY else self._pread(fh, offset, nbytes)

    def _pread(self, fh, offset: int, nbytes: int) -> np.ndarray:
        """nbytes at offset, read into a reused buffer: no fresh allocation per chunk, and the
        bytes are still in the CPU cache when the CRC and zstd read them."""
        if len(self._scratch) < nbytes:
            self._scratch = bytearray(nbytes)
        view = memoryview(self._scratch)[:nbytes]
        if os.preadv(fh.fileno(), [view], offset) != nbytes:
            raise PipelineError(f"{fh.name}: truncated (wanted bytes {offset}..{offset + nbytes})")
        return np.frombuffer(view, dtype=np.uint8)

    def _decode(self, path: str, c: int, encoded: np.ndarray, target: np.ndarray) -> None:
        frame = encoded[:-4]
        if google_crc32c.value(frame) != int.from_bytes(encoded[-4:].tobytes(), "little"):
            raise PipelineError(f"{path}: inner chunk {c}: CRC32C mismatch")
        declared = frame_content_size(frame[:18].tobytes())
        if declared != self.chunk_bytes:
            raise PipelineError(f"{path}: inner chunk {c}: zstd frame declares {declared} bytes, "
                                f"the chunk has {self.chunk_bytes}")
        try:
            self._zstd.decode(frame, out=target)
        except (RuntimeError, ValueError) as e:
            raise PipelineError(f"{path}: inner chunk {c}: {e}") from None

    def _place(self, chunk: np.ndarray, c: int, a: int, b: int, out: np.ndarray) -> None:
        lo = c * self.chunk_tokens
        s, e = max(a, lo), min(b, lo + self.chunk_tokens)
        out[s - a:e - a] = chunk[s - lo:e - lo]
