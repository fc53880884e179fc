"""Reading every sample of a cache in bounded memory, for the checks that visit them all.

Token arrays are read in windows of whole samples (at most WINDOW_TOKENS tokens, or one longer
sample): a handful of reads per window, not one per sample, and never a whole shard at once.
"""

from __future__ import annotations

import numpy as np

from pipeline.cache.reader import CacheReader
from pipeline.cache.schema import SAMPLE_TOKENS, role_names
from pipeline.errors import PipelineError

WINDOW_TOKENS = 1 << 18  # about 70 MB of per-token arrays at top-k 32


def sound_shards(reader: CacheReader, shards: list[str]):
    """(name, ShardReader) for the shards that exist and whose declared shapes match the manifest;
    the others are reported by check_structure and never read."""
    for name in shards:
        if not reader.present(name):
            continue
        try:
            yield name, reader.shard(name)
        except PipelineError:
            continue


def sample_windows(offsets: np.ndarray, max_tokens: int = WINDOW_TOKENS):
    """(first_row, last_row_exclusive) windows of whole samples, each at most max_tokens (or one sample)."""
    lo = 0
    while lo < len(offsets) - 1:
        hi = lo + 1
        while hi < len(offsets) - 1 and offsets[hi + 1] - offsets[lo] <= max_tokens:
            hi += 1
        yield lo, hi
        lo = hi


def shard_tokens(shard, names=role_names(SAMPLE_TOKENS), *, tap: int | None = None, max_tokens: int | None = None):
    """Per sample of a shard: (row, sample id, {name: array}), read in windows of whole samples
    (a handful of reads per window, not per sample). With `tap`, also "tap": that tap's hidden
    states decoded to float32 (the other taps are not decoded)."""
    for lo, hi in sample_windows(shard.offsets, max_tokens or WINDOW_TOKENS):
        a, b = int(shard.offsets[lo]), int(shard.offsets[hi])
        arrays = {name: shard.read_range(name, a, b) for name in names}
        if tap is not None:
            arrays["tap"] = shard.hidden_range(a, b, tap)
        for row in range(lo, hi):
            s, e = int(shard.offsets[row]) - a, int(shard.offsets[row + 1]) - a
            yield row, int(shard.sample_ids[row]), {name: arr[s:e] for name, arr in arrays.items()}
