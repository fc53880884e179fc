"""How well the training order mixes shards (issue 17): distinct shards per global batch.

The qwen3.6-27b preset (batch_sequences 64) on a 64-shard plan of `--rows` dataset rows, the
order of one epoch with `mix_shards` 1 (what the trainer did before: one shard after another)
and with the default. A shard holds a contiguous range of rows, so one shard per batch means one
slice of a dataset that was concatenated by source.

  python benchmarks/training/mixing.py --json
  python benchmarks/training/mixing.py --curve --json   # + the embedded training curve, mix_shards 1 vs default

The curve: the embedded target's training conversations extracted into 8 shards, the tiny
preset trained for 750 steps with each order; accuracy and avg_streak at steps 100, 300, 750.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from presets import load_preset  # noqa: E402
from pipeline.config import Data  # noqa: E402
from pipeline.cache.shard_plan import shard_rows  # noqa: E402
from pipeline.training.stream import EpochOrder  # noqa: E402
from pipeline.records.run_dir import RunDir  # noqa: E402
from pipeline.records.train_log import read_train_log  # noqa: E402


def distinct_per_batch(sizes: dict[str, int], batch: int, mix: int) -> list[int]:
    order = EpochOrder(sizes, seed=0, epoch=0, mix_shards=mix)
    out = []
    for start in range(0, len(order) - batch + 1, batch):
        out.append(len({order[p][0] for p in range(start, start + batch)}))
    return out


def curve(steps=(100, 300, 750)) -> dict:
    import tempfile

    from pipeline.config import ExtractConfig
    from stages.extract.run import run_extract
    from stages.train.run import resolve_config, run_train

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        run_extract(ExtractConfig(cache=str(cache), num_shards=8), None, progress=False)
        for mix in sorted({1, Data.mix_shards}):
            run = Path(tmp) / f"run-{mix}"
            cfg, preset_target = resolve_config(None, {"cache": str(cache), "out": str(run), "max_steps": max(steps),
                                                       "log_every": 50, "mix_shards": mix})
            run_train(cfg, preset_target=preset_target, warn=lambda *_: None)
            log = {line.step: line for line in read_train_log(RunDir(run).train_log)}
            out[f"mix_shards={mix}"] = {s: {"accuracy": round(log[s].accuracy, 4), "avg_streak": round(log[s].avg_streak, 3)}
                                        for s in steps}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="dataset rows in the shard plan (default %(default)s)")
    parser.add_argument("--shards", type=int, default=64, help="shards in the plan (default %(default)s)")
    parser.add_argument("--curve", action="store_true", help="also train the tiny preset with each order")
    parser.add_argument("--json", action="store_true", help="print the result as JSON, not as a Python dict")
    args = parser.parse_args()
    batch = load_preset("qwen3.6-27b")["drafter"]["batch_sequences"]
    # Bad values end here in one line, not in a traceback from min() of no batches.
    if args.shards < 1:
        parser.error(f"--shards must be at least 1, got {args.shards}")
    if args.rows < batch:
        parser.error(f"--rows must be at least one global batch ({batch} sequences), got {args.rows}")
    sizes = {f"shard-{s:05d}": len(shard_rows(s, args.rows, args.shards)) for s in range(args.shards)}
    result = {"rows": args.rows, "shards": args.shards, "batch_sequences": batch}
    for mix in sorted({1, Data.mix_shards}):
        counts = distinct_per_batch(sizes, batch, mix)
        result[f"mix_shards={mix}"] = {"batches": len(counts), "min": min(counts), "median": statistics.median(counts),
                                        "mean": round(statistics.mean(counts), 2), "max": max(counts)}
    if args.curve:
        result["embedded_curve"] = curve()
    print(json.dumps(result, indent=1) if args.json else result)


if __name__ == "__main__":
    main()
