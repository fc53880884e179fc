"""CPU threads on a busy machine: `pipeline eval` with torch's default threads vs fewer, idle and
with other jobs running.

    python benchmarks/decoding/threads.py --drafter RUN [--hogs 2] [--limit 20] [--rounds 2] [--json]

The other jobs are `--hogs` processes spinning on the CPU (pure Python loops, one core each) for
the duration of a run. Each condition runs `pipeline --threads T eval --drafter RUN --limit N
--tree-budget 16` as a subprocess (wall time, the threads `--threads auto` chose), conditions
interleaved per round so drift hits them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]


def eval_once(drafter: Path, threads: str, limit: int) -> tuple[float, int]:
    """(wall seconds, the CPU threads eval reported)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cli", "--threads", threads, "eval", "--drafter", str(drafter),
                           "--limit", str(limit), "--tree-budget", "16", "--json"],
                          cwd=HERE, env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - started, json.loads(done.stdout)["cpu_threads"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, required=True, help="a training run directory (RUN) for pipeline eval")
    parser.add_argument("--hogs", type=int, default=os.cpu_count(), help="busy processes while loaded (default: one per core)")
    parser.add_argument("--limit", type=int, default=20, help="held-out prompts per eval (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all conditions (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    if not (args.drafter / "run.json").is_file() and not (args.drafter / "config.json").is_file():
        parser.error(f"--drafter: {args.drafter} is not a run directory or drafter export")
    for name in ("hogs", "limit", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    default = str(os.cpu_count())
    conditions = [(load, threads) for load in ("idle", "loaded") for threads in (default, "1", "auto")]
    times: dict[tuple[str, str], list[float]] = {c: [] for c in conditions}
    chosen: dict[tuple[str, str], int] = {}
    for _ in range(args.rounds):
        for load, threads in conditions:
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)] \
                if load == "loaded" else []
            try:
                time.sleep(1.0 if hogs else 0)   # let the load show in /proc/stat before auto looks
                seconds, used = eval_once(args.drafter, threads, args.limit)
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
            times[(load, threads)].append(seconds)
            chosen[(load, threads)] = used
    rows = [{"load": load, "threads_option": threads, "threads_used": chosen[(load, threads)],
             "wall_s": [round(t, 1) for t in times[(load, threads)]], "median_s": round(statistics.median(times[(load, threads)]), 1)}
            for load, threads in conditions]
    result = {"cores": os.cpu_count(), "hogs": args.hogs, "limit": args.limit, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for r in rows:
            print(f"{r['load']:>7} --threads {r['threads_option']:>4} (used {r['threads_used']}): median {r['median_s']} s {r['wall_s']}")


if __name__ == "__main__":
    main()
