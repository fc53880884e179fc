"""Read a cache: the manifest, committed shards, one sample's positions without decoding the shard.

Only shards listed in the manifest are visible. Per-sample arrays (offsets, sample_id) are read
once per shard (16 bytes a sample); token arrays are read by slice, which decodes only the
chunks that overlap it. Chunk checksums (CRC32C) are verified by Zarr on every read.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import zarr

from pipeline.cache.encoding import decode_bf16, decode_fp8
from pipeline.cache.files import link_refused, regular_files
from pipeline.cache.manifest import read_manifest
from pipeline.cache.schema import check_dims, shard_index, shard_name
from pipeline.errors import PipelineError


def _refuse_links(path: Path) -> None:
    """The cheap part of the link check, on every open: the shard, its arrays' directories and
    metadata, and the small per-sample arrays. (Links among the millions of hidden-state chunks
    are found by verify-cache, which walks every file.)"""
    try:
        if path.is_symlink():
            raise link_refused(path)
        for entry in os.scandir(path):
            subs = list(os.scandir(entry.path)) if entry.is_dir(follow_symlinks=False) else []
            linked = [e.path for e in (entry, *subs) if e.is_symlink()]
            if linked:
                raise link_refused(linked[0])
        for name in ("offsets", "sample_id"):
            if (path / name).is_dir():
                regular_files(path / name)
    except OSError as e:
        raise PipelineError(f"{path}: cannot open shard ({e.strerror})") from None


class ShardReader:
    def __init__(self, path: Path, hidden_format: str, *, chunk_cache_bytes: int = 0,
                 expected: tuple[int, int] | None = None):
        """`chunk_cache_bytes` > 0 keeps that many bytes of decoded chunks (least recently used
        dropped first): a shuffled pass over a shard whose samples are smaller than a chunk then
        decodes (and CRC-checks) each chunk once instead of once per sample."""
        self.path = path
        self.hidden_format = hidden_format
        self.cache_bytes = chunk_cache_bytes
        self._chunks: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._cached = 0
        self._arrays: dict = {}
        _refuse_links(path)
        try:
            self.group = zarr.open_group(str(path), mode="r", zarr_format=3)
            if expected is not None:
                self._check_declared_shapes(*expected)
            self.offsets = self.group["offsets"][:]
            self.sample_ids = self.group["sample_id"][:]
        except Exception as e:  # noqa: BLE001 - zarr raises many types; the message names the shard
            raise PipelineError(f"{path}: cannot open shard ({type(e).__name__}: {e})") from None
        self.row_of = {int(s): i for i, s in enumerate(self.sample_ids)}

    def _check_declared_shapes(self, samples, tokens) -> None:
        """Shapes a shard's metadata declares must match the manifest's counts before anything is
        read: a shard is untrusted input, and a declared petabyte array must not be allocated."""
        if not isinstance(samples, int) or not isinstance(tokens, int):
            raise PipelineError(f"{self.path}: the manifest has no sample/token counts for this shard")
        for name, array in self.group.arrays():
            first = array.shape[0] if array.shape else None
            want = samples + 1 if name == "offsets" else samples if name == "sample_id" else tokens
            if first != want:
                raise PipelineError(f"{self.path}/{name}: declares shape {tuple(array.shape)}, but the manifest "
                                    f"says {samples} samples and {tokens} tokens")

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
            return self._cached_range(name, a, b) if self.cache_bytes else self.array(name)[a:b]
        except Exception as e:  # noqa: BLE001
            raise PipelineError(f"{self.path}/{name}: read of sample {sample_id} failed ({type(e).__name__}: {e})") from None

    def array(self, name: str):
        """The opened Zarr array (opening one re-reads its metadata, so it is done once)."""
        if name not in self._arrays:
            self._arrays[name] = self.group[name]
        return self._arrays[name]

    def _cached_range(self, name: str, a: int, b: int) -> np.ndarray:
        array = self.array(name)
        size = array.chunks[0]
        parts = []
        for c in range(a // size, (b - 1) // size + 1 if b > a else a // size):
            key = (name, c)
            chunk = self._chunks.get(key)
            if chunk is None:
                chunk = array[c * size:min((c + 1) * size, array.shape[0])]
                self._chunks[key] = chunk
                self._cached += chunk.nbytes
                while self._cached > self.cache_bytes and len(self._chunks) > 1:
                    self._cached -= self._chunks.popitem(last=False)[1].nbytes
            else:
                self._chunks.move_to_end(key)
            parts.append(chunk[max(a - c * size, 0):b - c * size])
        if not parts:
            return array[a:b]
        return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)

    def read_range(self, name: str, a: int, b: int) -> np.ndarray:
        """Token (or sample) range [a, b) of one array, by global position inside the shard."""
        try:
            return self.array(name)[a:b]
        except Exception as e:  # noqa: BLE001
            raise PipelineError(f"{self.path}/{name}[{a}:{b}]: read failed ({type(e).__name__}: {e})") from None

    def hidden(self, sample_id: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Decoded taps [tokens, n_taps, H] (bfloat16 for bf16 caches, float32 for fp8)."""
        bits = self.read("hidden", sample_id, start, stop)
        if self.hidden_format == "bf16":
            return decode_bf16(bits)
        return decode_fp8(bits, self.read("hidden_scale", sample_id, start, stop))

    def hidden_range(self, a: int, b: int, tap: int) -> torch.Tensor:
        """One tap decoded to float32 [b - a, H] over token range [a, b) of the shard (the other
        taps are read but never decoded): what a check over many samples at once needs."""
        bits = self.read_range("hidden", a, b)[:, tap]
        if self.hidden_format == "bf16":
            return decode_bf16(bits).float()
        return decode_fp8(bits, self.read_range("hidden_scale", a, b)[:, tap])

    def sample(self, sample_id: int) -> dict:
        """Every array of one sample, hidden states decoded."""
        names = ["input_ids", "loss_mask", "target_argmax", "target_topk_ids", "target_topk_logits", "target_logsumexp"]
        out = {name: self.read(name, sample_id) for name in names}
        out["hidden"] = self.hidden(sample_id)
        return out


class CacheReader:
    def __init__(self, cache_dir: str | Path):
        self.dir = Path(cache_dir)
        manifest = read_manifest(self.dir)
        if manifest is None:
            raise PipelineError(f"{self.dir}: no manifest.json (not a cache, or no shard committed yet)")
        self.manifest = manifest
        try:
            capture = manifest["config"]["capture"]
            check_dims({"n_taps": len(capture["target_layer_ids"]), "hidden_size": capture["hidden_size"],
                        "top_k": capture["top_k"], "vocab_size": capture["vocab_size"]})
        except (KeyError, TypeError, ValueError) as e:
            raise PipelineError(f"{self.dir / 'manifest.json'}: bad capture record ({type(e).__name__}: {e})") from None
        self.hidden_format = capture["hidden_format"]
        self.shards = sorted(manifest["shards"], key=shard_index)
        self._files: dict[str, list[Path]] = {}

    def files(self, name: str) -> list[Path]:
        """Every file of a shard, links and special files refused; walked once per reader
        (verify-cache's checks each need it, and a large shard holds ~10^5 chunk files)."""
        if name not in self._files:
            self._files[name] = regular_files(self.dir / name)
        return self._files[name]

    def shard(self, name_or_index: str | int, *, chunk_cache_bytes: int = 0) -> ShardReader:
        name = shard_name(name_or_index) if isinstance(name_or_index, int) else name_or_index
        if name not in self.manifest["shards"]:
            raise PipelineError(f"{self.dir}: {name} is not a committed shard")
        record = self.manifest["shards"][name]
        return ShardReader(self.dir / name, self.hidden_format, chunk_cache_bytes=chunk_cache_bytes,
                           expected=(record.get("samples"), record.get("tokens")))

    def find(self, sample_id: int) -> ShardReader:
        for name in self.shards:
            rec = self.manifest["shards"][name]
            if rec["sample_id_min"] <= sample_id <= rec["sample_id_max"]:
                reader = self.shard(name)
                if sample_id in reader.row_of:
                    return reader
        raise PipelineError(f"{self.dir}: sample {sample_id} is in no committed shard")

    def sample_ids(self) -> list[int]:
        ids: list[int] = []
        for name in self.shards:
            ids += [int(s) for s in self.shard(name).sample_ids]
        return sorted(ids)
