"""The kill -9 trial table: extraction killed at every phase, then resumed.

    python benchmarks/cache/kill_table.py [--rows 24] [--per-failpoint 4] [--timed 4] [--json]

Runs harness/kill_trials.py (one process per trial, SIGKILL at a random hit of each failpoint or
after a random delay, the writer inline and on its thread alternately; small chunking so that
kills land between the file writes of a shard) and then, per trial, compares the resumed cache
with the uninterrupted reference sample by sample (every array, exactly). Prints one row per
phase: trials, killed, listed shards intact after the kill, resumed OK, content identical.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from harness.caches import assert_same_content  # noqa: E402
from harness.kill_trials import SMALL_FILES, run_trials  # noqa: E402
from harness.runs import write_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=24,
                        help="conversations from the embedded training data to extract (default %(default)s)")
    parser.add_argument("--shards", type=int, default=3, help="shards of the extraction (default %(default)s)")
    parser.add_argument("--per-failpoint", type=int, default=4,
                        help="trials killed at a random hit of each failpoint (default %(default)s)")
    parser.add_argument("--timed", type=int, default=4,
                        help="trials killed after a random delay instead (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON, not as a markdown table")
    args = parser.parse_args()
    # Bad values end here in one line, not in a traceback from the trial runner.
    for name, least in (("rows", 1), ("shards", 1), ("per_failpoint", 0), ("timed", 0)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(args, name)}")
    available = (REPO / "pipeline/embedded/data/train.jsonl").read_text().splitlines()
    if args.rows > len(available):
        parser.error(f"--rows must be at most {len(available)} (the embedded training conversations), got {args.rows}")
    rows = [json.loads(line) for line in available[:args.rows]]
    with tempfile.TemporaryDirectory(prefix="dflash-kill-") as tmp:
        root = Path(tmp)
        data = write_rows(root / "convs.jsonl", rows)
        plan = {"root": str(root), "data": str(data), "num_shards": args.shards, "batch_tokens": 256, "seed": 9,
                "per_failpoint": args.per_failpoint, "timed": args.timed, "chunking": SMALL_FILES}
        try:
            report = run_trials(plan, root / "plan.json", timeout=None)
        except RuntimeError as e:
            sys.exit(str(e))
        table = defaultdict(lambda: defaultdict(int))
        for trial in report["trials"]:
            phase = trial["failpoint"].split("@")[0] if "failpoint" in trial else "random delay"
            row = table[phase]
            row["trials"] += 1
            row["killed"] += trial["run"] == "killed"
            row["listed_intact_after_kill"] += trial["after_kill"]["listed_intact"]
            row["shards_listed_after_kill"] += len(trial["after_kill"]["listed"])
            row["resumed_ok"] += trial["resume"] == "ok" and trial["after_resume"]["listed_intact"] \
                and not trial["after_resume"]["partial"] and len(trial["after_resume"]["listed"]) == args.shards
            try:
                assert_same_content(Path(trial["cache"]), Path(report["reference"]))
                row["content_identical"] += 1
            except AssertionError:
                pass
        hits = report["hits"]
    out = {"rows": args.rows, "shards": args.shards, "failpoint_hits_in_reference": hits, "seconds": report["seconds"],
           "phases": {k: dict(v) for k, v in table.items()}}
    if args.json:
        print(json.dumps(out))
        return
    print("| phase killed at | hits in a full run | trials | killed | listed shards intact after the kill "
          "| shards listed after the kill | resumed to all shards | content identical to uninterrupted |")
    print("|---|---|---|---|---|---|---|---|")
    for phase, row in table.items():
        print(f"| {phase} | {hits.get(phase, '-')} | {row['trials']} | {row['killed']} | {row['listed_intact_after_kill']} "
              f"| {row['shards_listed_after_kill']} | {row['resumed_ok']} | {row['content_identical']} |")
    print(f"\n{sum(r['trials'] for r in table.values())} trials in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
