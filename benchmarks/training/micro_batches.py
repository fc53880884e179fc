"""Micro-batches cut by size against the stream's order (issue 59), side by side in one run.

    python benchmarks/training/micro_batches.py [--cache DIR] [--steps 20] [--rounds 3] [--forward-costs 20000,70000,150000] [--json]

On a cache of the embedded tiny target (its 1,000 training conversations extracted here unless
--cache is given) with the `tiny` preset (8 sequences a step, up to 8 a micro-batch):

1. Padding: the share of the padded queries, and of the padded work (query-context pairs plus
   each query's projections, pipeline/training/micro_batches.py), that is real, per step, in the
   stream's order and cut by size.
2. Steps: the same batches from the same weights, forward + backward + update, in the stream's
   order, cut by size at each `--forward-costs` value (the constant FORWARD_COST is chosen from
   this), and one sequence per micro-batch; rounds alternate the variants and medians are
   reported, with each variant's summed loss (equal up to float rounding: the cut changes only
   the order of the sum).
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.cli_args import at_least_one, positive_ints  # noqa: E402
from benchmarks.training.train_throughput import cache_or_extract, setup, stream_batches  # noqa: E402
from pipeline.training import micro_batches  # noqa: E402
from pipeline.training.micro_batches import Sizes, padded_work  # noqa: E402


def padding(batches, runner) -> dict:
    """Real over padded queries and work, summed over the steps, stream order and cut."""
    stream, cut = {"queries": [0, 0], "work": [0, 0]}, {"queries": [0, 0], "work": [0, 0]}
    for batch in batches:
        items = [(sid, seq) for sid, seq in batch if seq is not None]
        sizes = [Sizes.of(seq) for _, seq in items]
        real_q = sum(s.anchors for s in sizes)
        real_w = sum(padded_work([s], runner.per_query) for s in sizes)
        for table, stream_order in ((stream, True), (cut, False)):
            runner.stream_order = stream_order
            for group in runner.micro_batches(items):
                g = [Sizes.of(seq) for _, seq in group]
                table["queries"][1] += len(g) * max(s.anchors for s in g)
                table["work"][1] += padded_work(g, runner.per_query)
            table["queries"][0] += real_q
            table["work"][0] += real_w
    runner.stream_order = False
    return {name: {k: round(real / padded, 3) for k, (real, padded) in table.items()}
            for name, table in (("stream_order", stream), ("cut", cut))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, help="a cache of the embedded target (default: extract one here)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="rounds alternating the variants (medians reported)")
    parser.add_argument("--forward-costs", default="20000,70000,150000",
                        help="FORWARD_COST values to cut with, comma-separated")
    parser.add_argument("--json", action="store_true", help="print the result as JSON, not as a table")
    args = parser.parse_args()
    at_least_one(parser, args, "steps", "rounds")
    args.forward_costs = positive_ints(parser, "--forward-costs", args.forward_costs)
    if args.cache is not None and not (args.cache / "manifest.json").is_file():
        parser.error(f"--cache: no cache at {args.cache} (no manifest.json)")

    with tempfile.TemporaryDirectory() as tmp:
        cfg, reader, runner = setup(cache_or_extract(args.cache, tmp))
        batches = list(stream_batches(cfg, reader, runner, args.steps))
        start = copy.deepcopy((runner.drafter.state_dict(), runner.optimizer.state_dict()))
        variants = {"stream_order": (True, None, runner.plan.micro),
                    **{f"cut_{fc}": (False, fc, runner.plan.micro) for fc in args.forward_costs},
                    "one_per_micro_batch": (True, None, 1)}
        seconds, losses = {name: [] for name in variants}, {}
        micro = runner.plan.micro
        for _ in range(args.rounds):
            for name, (stream_order, forward_cost, cap) in variants.items():
                runner.drafter.load_state_dict(start[0])
                runner.optimizer.load_state_dict(start[1])
                runner.stream_order = stream_order
                micro_batches.FORWARD_COST = forward_cost or micro_batches.FORWARD_COST
                runner.plan.micro = cap
                fresh = copy.deepcopy(batches)
                t0 = time.perf_counter()
                out = [runner.step(b, i, with_metrics=False)["local_loss"] for i, b in enumerate(fresh)]
                seconds[name].append((time.perf_counter() - t0) / len(fresh))
                losses[name] = sum(out)
        runner.plan.micro = micro
        step_s = {name: statistics.median(v) for name, v in seconds.items()}
        result = {
            "steps": args.steps, "rounds": args.rounds, "threads": torch.get_num_threads(),
            "batch_sequences": cfg.batch_sequences, "micro_batch_sequences": micro,
            "real_share": padding(batches, runner),
            "step_s": {k: round(v, 4) for k, v in step_s.items()},
            "over_stream_order": {k: round(step_s["stream_order"] / v, 2) for k, v in step_s.items()},
            "summed_loss": {k: round(v, 6) for k, v in losses.items()},
        }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    from pipeline.ui import console, key_value_table
    console.print(key_value_table("micro-batches by size", list(result.items())))


if __name__ == "__main__":
    main()
