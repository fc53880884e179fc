"""How well the training order mixes shards (issue 17): distinct shards per global batch.

The qwen3.6-27b preset (batch_sequences 64) on a 64-shard plan of `--rows` dataset rows, the
order of one epoch with `mix_shards` 1 (what the trainer did before: one shard after another)
and with the default. A shard holds a contiguous range of rows, so one shard per batch means one
slice of a dataset that was concatenated by source.

  python benchmarks/mixing.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from manifests import load_preset  # noqa: E402
from pipeline.config import TrainConfig  # noqa: E402
from pipeline.data.shard_plan import shard_rows  # noqa: E402
from pipeline.drafter.stream import EpochOrder  # noqa: E402


def distinct_per_batch(sizes: dict[str, int], batch: int, mix: int) -> list[int]:
    order = EpochOrder(sizes, seed=0, epoch=0, mix_shards=mix)
    out = []
    for start in range(0, len(order) - batch + 1, batch):
        out.append(len({order[p][0] for p in range(start, start + batch)}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    batch = load_preset("qwen3.6-27b")["drafter"]["batch_sequences"]
    sizes = {f"shard-{s:05d}": len(shard_rows(s, args.rows, args.shards)) for s in range(args.shards)}
    result = {"rows": args.rows, "shards": args.shards, "batch_sequences": batch}
    for mix in sorted({1, TrainConfig.mix_shards}):
        counts = distinct_per_batch(sizes, batch, mix)
        result[f"mix_shards={mix}"] = {"batches": len(counts), "min": min(counts), "median": statistics.median(counts),
                                        "mean": round(statistics.mean(counts), 2), "max": max(counts)}
    print(json.dumps(result, indent=1) if args.json else result)


if __name__ == "__main__":
    main()
