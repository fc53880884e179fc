"""The pilot a basis is fitted on: the first tokens of a cache's committed shards, in shard order,
their taps concatenated (n_taps * hidden_size values a token) and decoded to float32."""

from __future__ import annotations

from collections.abc import Callable

from pipeline.cache.encoding import decode_hidden
from pipeline.projection.basis import SecondMoment

# Tokens read and added at once: [4096, n*H] float32 is 420 MB at the flagship's 25,600 values.
BATCH_TOKENS = 4096


def pilot_moment(reader, tokens: int, progress: Callable[[int], None] | None = None) -> SecondMoment:
    """The second moment of the taps of the cache's first `tokens` tokens (fewer where the cache
    holds fewer)."""
    dims = reader.manifest.identity.capture.dims()
    width = dims["n_taps"] * dims["hidden_size"]
    moment = SecondMoment(width)
    for name in sorted(reader.shards):
        shard = reader.shard(name)
        for a in range(0, shard.num_tokens, BATCH_TOKENS):
            b = min(shard.num_tokens, a + BATCH_TOKENS, a + tokens - moment.tokens)
            taps = decode_hidden(shard.hidden_format, lambda array: shard.read_range(array, a, b))
            moment.add(taps.reshape(b - a, width).float())
            if progress is not None:
                progress(moment.tokens)
            if moment.tokens >= tokens:
                return moment
    return moment
