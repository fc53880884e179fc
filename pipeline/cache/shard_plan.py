"""Which sample goes to which shard, and which shards an invocation writes.

The assignment is a pure function of (number of rows, num_shards): shard s holds rows
[s*N//S, (s+1)*N//S). It never depends on how many GPUs, processes or nodes run extraction.
"""

from __future__ import annotations

from pipeline.errors import PipelineError


def shard_rows(shard: int, num_rows: int, num_shards: int) -> range:
    return range(shard * num_rows // num_shards, (shard + 1) * num_rows // num_shards)


def parse_shards(spec: str | None, num_shards: int) -> list[int]:
    """'0-63', '3,5,8-11' -> sorted unique shard indices; None -> all."""
    if spec is None or spec.strip() in ("", "all"):
        return list(range(num_shards))
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
            else:
                lo = hi = int(part)
        except ValueError:
            raise PipelineError(f"--shards: {part!r} is not a shard index or range like 3 or 8-11") from None
        if lo > hi:
            raise PipelineError(f"--shards: range {part!r} is empty")
        if lo < 0 or hi >= num_shards:
            raise PipelineError(f"--shards: {part!r} is outside 0-{num_shards - 1} (the cache has {num_shards} shards)")
        out.update(range(lo, hi + 1))
    return sorted(out)


def assign_to_groups(shards: list[int], num_groups: int, group: int) -> list[int]:
    """Round-robin split of the selected shards among data-parallel groups."""
    return shards[group::num_groups]
