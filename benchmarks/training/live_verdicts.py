"""Which live verdict fires, at which step, for a clean run and for each planted fault.

    python benchmarks/training/live_verdicts.py [--steps 60] [--log-every 2] [--rows 240] [--json]

Trains the tiny preset on a cache of the embedded training conversations: once clean, and once
with each test-only planted fault (PIPELINE_PLANT: `random_labels`, every label a random token;
`lr_blowup`, the learning rate x1000 from step pipeline.faults.LR_BLOWUP_STEP), and lists the
verdicts each run fired while it trained (RUN/verdicts.jsonl), with the run's final loss and
accuracy. Verdicts are checked every 5 log lines (the default --verdict-every).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE))

from benchmarks.cli_args import at_least_one  # noqa: E402

RUNS = [("clean", None), ("random_labels", "random_labels"), ("lr_blowup", "lr_blowup")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="Training steps per run.")
    parser.add_argument("--log-every", type=int, default=2, help="Steps between log lines.")
    parser.add_argument("--rows", type=int, default=240, help="Training conversations in the cache.")
    parser.add_argument("--json", action="store_true", help="Print one JSON document.")
    args = parser.parse_args()
    at_least_one(parser, args, "steps", "log_every", "rows")

    from harness.runs import small_cache
    from pipeline import embedded
    from pipeline.faults import LR_BLOWUP_STEP, PLANT_ENV
    from pipeline.records.verdicts import read_verdicts
    from stages.train.run import resolve_config, run_train

    rows = [json.loads(x) for x in embedded.TRAIN_DATA.read_text().splitlines()[:args.rows]]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cache = small_cache(root, rows, 2)
        for name, plant in RUNS:
            os.environ.pop(PLANT_ENV, None)
            if plant:
                os.environ[PLANT_ENV] = plant
            out = root / name
            cfg, preset = resolve_config(None, {"cache": str(cache), "out": str(out), "max_steps": args.steps,
                                                "log_every": args.log_every})
            summary = run_train(cfg, preset_target=preset, warn=lambda *_: None)
            fired = read_verdicts(out)
            results.append({"run": name, "verdicts": [{"cause": v["cause"], "step": v["step"], "message": v["message"]}
                                                      for v in fired],
                            "final_loss": summary["last"]["loss"], "final_accuracy": summary["last"]["accuracy"]})
        os.environ.pop(PLANT_ENV, None)
    result = {"steps": args.steps, "log_every": args.log_every, "lr_blowup_step": LR_BLOWUP_STEP, "runs": results}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for r in results:
        fired = "; ".join(f"{v['cause']} at step {v['step']}" for v in r["verdicts"]) or "none"
        print(f"{r['run']:<14} final loss {r['final_loss']:.3f}, accuracy {r['final_accuracy']:.3f}; fired: {fired}")
        for v in r["verdicts"]:
            print(f"    {v['cause']}: {v['message']}")


if __name__ == "__main__":
    main()
