"""What `--report-to tensorboard,wandb,mlflow,trackio` costs a training run.

    python benchmarks/training/tracking_overhead.py [--steps 60] [--log-every 1] [--rounds 2] [--rows 160] [--json]

Trains the tiny preset on a cache of the embedded training conversations, without trackers and
with all four (offline, files under a temporary folder), the two arms interleaved per round
(their order swapped every round) in one process. Training tokens/s of an arm = the tokens of
the steps between its first and last log line / the wall time between them (the log's
elapsed_s): every tracker call in between is inside
that time, the trackers' start (imports, W&B's service) and close are not. `--log-every 1` is
the worst case: every step reports. The headline is the ratio of the medians with and without,
and every round's ratio is printed beside it. Then each tracker alone: CPU and wall
milliseconds per log line (the last line of the tracked run's log, 200 times), the cost to set
against a step's time at a given --log-every.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE))

from benchmarks.cli_args import at_least_one  # noqa: E402
from pipeline.records.run_dir import RunDir  # noqa: E402
from pipeline.records.train_log import read_train_log  # noqa: E402

ALL = "tensorboard,wandb,mlflow,trackio"


def one_run(cache: Path, out: Path, *, steps: int, log_every: int, report_to: str | None) -> dict:
    from stages.train.run import resolve_config, run_train

    cfg, preset = resolve_config(None, {"cache": str(cache), "out": str(out), "max_steps": steps,
                                        "log_every": log_every, "report_to": report_to})
    t0 = time.perf_counter()
    run_train(cfg, preset_target=preset, warn=lambda *_: None)
    total = time.perf_counter() - t0
    log = [line.to_json() for line in read_train_log(RunDir(out).train_log)]
    first, last = log[0], log[-1]
    # Each step trains the same tokens in both arms (same data, seed and anchors), so the ratio of
    # steps/s is the ratio of tokens/s.
    steps_between = last["step"] - first["step"]
    seconds = last["elapsed_s"] - first["elapsed_s"]
    return {"steps_timed": steps_between, "seconds": seconds, "steps_per_s": steps_between / seconds,
            "wall_s": total}


def per_log_cost(root: Path, record: dict, calls: int = 200) -> dict:
    """Each tracker alone: wall and process CPU milliseconds (its background threads included) per
    log line of `record`'s keys, over `calls` lines and the close that writes what is buffered."""
    from pipeline.tracking import open_trackers

    out = {}
    for name in ALL.split(","):
        trackers = open_trackers([name], run_dir=root / f"cost-{name}", run_name="cost", params={"x": 1}, start_step=0)
        wall, cpu = time.perf_counter(), time.process_time()
        for step in range(1, calls + 1):
            trackers.log({**record, "step": step})
        trackers.close()
        out[name] = {"wall_ms": (time.perf_counter() - wall) * 1e3 / calls, "cpu_ms": (time.process_time() - cpu) * 1e3 / calls}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="Training steps per run.")
    parser.add_argument("--log-every", type=int, default=1, help="Steps between log lines (1: every step reports).")
    parser.add_argument("--rounds", type=int, default=2, help="Rounds; each trains once without and once with trackers.")
    parser.add_argument("--rows", type=int, default=160, help="Training conversations in the cache.")
    parser.add_argument("--json", action="store_true", help="Print one JSON document.")
    args = parser.parse_args()
    at_least_one(parser, args, "steps", "log_every", "rounds", "rows")

    from harness.runs import small_cache

    from pipeline import embedded

    rows = [json.loads(x) for x in embedded.TRAIN_DATA.read_text().splitlines()[:args.rows]]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ.update({"TRACKIO_DIR": str(root / "trackio"), "WANDB_DIR": str(root),
                           "WANDB_CONFIG_DIR": str(root / "wandb-config"), "WANDB_CACHE_DIR": str(root / "wandb-cache"),
                           "WANDB_DATA_DIR": str(root / "wandb-data")})
        for key in ("MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_API_KEY"):
            os.environ.pop(key, None)
        cache = small_cache(root, rows, 2)
        rounds = []
        for r in range(args.rounds):
            # The arms swap order every round, so warm-up and drift do not favour one of them.
            arms = [("plain", None), ("tracked", ALL)][::1 if r % 2 == 0 else -1]
            runs = {name: one_run(cache, root / f"{name}-{r}", steps=args.steps, log_every=args.log_every,
                                  report_to=report_to) for name, report_to in arms}
            without, with_all = runs["plain"], runs["tracked"]
            rounds.append({"round": r + 1, "without_steps_per_s": without["steps_per_s"],
                           "with_steps_per_s": with_all["steps_per_s"],
                           "ratio": with_all["steps_per_s"] / without["steps_per_s"],
                           "with_wall_s": with_all["wall_s"], "without_wall_s": without["wall_s"]})
        costs = per_log_cost(root, read_train_log(RunDir(root / "tracked-0").train_log)[-1].to_json())
    ratio = statistics.median(x["with_steps_per_s"] for x in rounds) / statistics.median(x["without_steps_per_s"] for x in rounds)
    result = {"steps": args.steps, "log_every": args.log_every, "trackers": ALL, "rounds": rounds,
              "ratio_of_medians": ratio, "per_log_line": costs}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'round':>5} {'without steps/s':>16} {'with steps/s':>13} {'ratio':>6} {'wall without':>13} {'wall with':>10}")
    for x in rounds:
        print(f"{x['round']:>5} {x['without_steps_per_s']:>16.3f} {x['with_steps_per_s']:>13.3f} {x['ratio']:>6.3f} "
              f"{x['without_wall_s']:>12.1f}s {x['with_wall_s']:>9.1f}s")
    print(f"training tokens/s with all four trackers / without: {ratio:.3f} (ratio of the medians of {len(rounds)} "
          f"rounds; a log line every {args.log_every} steps)")
    print("per log line (each tracker alone, 200 lines): " + ", ".join(
        f"{name} {c['cpu_ms']:.2f} ms CPU / {c['wall_ms']:.2f} ms wall" for name, c in costs.items()))


if __name__ == "__main__":
    main()
