"""The chunked loss (issue 17) against the full-logits path it replaced, on the tiny preset:
optimizer steps per second side by side on the same batches and weights, and their losses.

    python benchmarks/training/loss_path.py [--cache DIR] [--steps 8] [--rounds 5] [--json]

A cache of the embedded target is extracted here unless --cache is given. Each round runs the
same `--steps` batches through the trainer's StepRunner twice, once per path (alternating which
goes first), from the same drafter and optimizer state; tokens/s per path, the ratio of the
medians, and the largest relative difference of the per-step losses.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.training.train_throughput import cache_or_extract, setup, stream_batches, tokens  # noqa: E402


def run(runner, batches, state, full: bool) -> tuple[float, list[float]]:
    runner.drafter.load_state_dict(state[0])
    runner.optimizer.load_state_dict(state[1])
    runner.full_logits = full
    start = time.perf_counter()
    losses = [runner.step(b, i, with_metrics=True)["loss"] for i, b in enumerate(batches)]
    return time.perf_counter() - start, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, help="a cache of the embedded target (default: extract one here)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per path per round (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds, each running both paths; medians are reported (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON, not as a Python dict")
    args = parser.parse_args()
    # Bad values end here in one line, not in a traceback after the setup.
    if args.cache is not None and not (args.cache / "manifest.json").is_file():
        parser.error(f"--cache: no cache at {args.cache} (no manifest.json)")
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    with tempfile.TemporaryDirectory() as tmp:
        cfg, reader, runner = setup(cache_or_extract(args.cache, tmp))
        batches = list(stream_batches(cfg, reader, runner, args.steps))
        state = copy.deepcopy((runner.drafter.state_dict(), runner.optimizer.state_dict()))
        rates = {"full": [], "chunked": []}
        losses = {}
        for r in range(args.rounds):
            for full in ((True, False) if r % 2 == 0 else (False, True)):
                seconds, losses["full" if full else "chunked"] = run(runner, batches, state, full)
                rates["full" if full else "chunked"].append(sum(map(tokens, batches)) / seconds)
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {"steps": args.steps, "rounds": args.rounds, "threads": torch.get_num_threads(),
              "batch_sequences": cfg.schedule.batch_sequences, "tokens_per_step": statistics.mean(map(tokens, batches)),
              "full_tok_s": round(med["full"], 1), "chunked_tok_s": round(med["chunked"], 1),
              "chunked_over_full": round(med["chunked"] / med["full"], 3),
              "all_rounds": {k: [round(x, 1) for x in v] for k, v in rates.items()},
              "max_rel_loss_difference": max(abs(a - b) / abs(a) for a, b in zip(losses["full"], losses["chunked"]))}
    print(json.dumps(result, indent=1) if args.json else result)


if __name__ == "__main__":
    main()
