"""Micro-batches cut by size against the stream's order (issue 59), side by side in one run.

    python benchmarks/training/micro_batches.py [--cache DIR] [--steps 20] [--rounds 3] [--forward-costs 20000,70000,150000]
        [--share 512] [--share-cap 128] [--cut-only] [--json]

On a cache of the embedded tiny target (its 1,000 training conversations extracted here unless
--cache is given) with the `tiny` preset (8 sequences a step, up to 8 a micro-batch):

1. Padding: the share of the padded queries, and of the padded work (query-context pairs plus
   each query's projections, pipeline/training/micro_batches.py), that is real, per step, in the
   stream's order and cut by size.
2. Steps: the same batches from the same weights, forward + backward + update, in the stream's
   order, cut by size at each `--forward-costs` value (the constant FORWARD_COST is chosen from
   this), and one sequence per micro-batch; rounds alternate the variants and medians are
   reported, with each variant's summed loss (equal up to float rounding: the cut changes only
   the order of the sum). `fewest_forwards` is the accelerator's rule run on the CPU.
3. The cut itself (issue 69 item 4): its Python time per share, before (`quadratic_cut`, a max
   over each slice) and after, on the tiny preset's shares and on one share of `--share`
   sequences of the same cache cut at most `--share-cap` a forward; and the forwards a share
   makes, before (one rule on every device) and after (the CPU's rule, the accelerator's).
4. The same steps on the simulated accelerator (harness/simulated_device.py), before (the CPU's
   rule there too) and after (the fewest forwards): forwards, device ops (aten ops on the device
   but views: about a kernel launch each on a GPU) and host syncs per step, and the summed loss.
   Counted, not timed: the simulation's speed says nothing of a GPU's.

`--cut-only` runs 3 and 4 alone (no timed steps).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.cli_args import at_least_one, positive_ints  # noqa: E402
from benchmarks.training.train_throughput import cache_or_extract, setup, stream_batches  # noqa: E402
from harness.simulated_device import SimTensor, simulated_accelerator  # noqa: E402
from pipeline.training.micro_batches import FORWARD_COST, Sizes, cut, forward_cost_on, padded_work  # noqa: E402


def quadratic_cut(sizes: list[Sizes], cap: int, *, per_query: int, forward_cost: int) -> list[list[int]]:
    """The cut before issue 69 item 4, kept as the reference it is timed against: the same dynamic
    program, but `padded_work` takes the maxima over each slice again (O(n * cap^2))."""
    if not sizes:
        return []
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i].anchors, -sizes[i].tokens, i))
    ranked = [sizes[i] for i in order]
    n = len(ranked)
    best = [0] + [None] * n
    cut_at = [0] * (n + 1)
    for i in range(1, n + 1):
        for j in range(max(0, i - cap), i):
            cost = best[j] + padded_work(ranked[j:i], per_query) + forward_cost
            if best[i] is None or cost < best[i]:
                best[i], cut_at[i] = cost, j
    runs, i = [], n
    while i > 0:
        runs.append(order[cut_at[i]:i])
        i = cut_at[i]
    return runs[::-1]


def share_sizes(batches) -> list[list[Sizes]]:
    return [[Sizes.of(seq) for _, seq in batch if seq is not None] for batch in batches]


def cut_ms(cut_fn, shares: list[list[Sizes]], cap: int, per_query: int, rounds: int) -> float:
    """Median over rounds of the mean milliseconds a share takes to cut (the CPU's rule)."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for sizes in shares:
            cut_fn(sizes, cap, per_query=per_query, forward_cost=FORWARD_COST)
        times.append((time.perf_counter() - t0) / len(shares) * 1000)
    return statistics.median(times)


def cut_cost(shares: dict[str, tuple[list[list[Sizes]], int]], per_query: int, rounds: int) -> dict:
    """The cut's Python time before and after, and the forwards a share makes under each rule."""
    out = {}
    for name, (group, cap) in shares.items():
        same = all(quadratic_cut(s, cap, per_query=per_query, forward_cost=FORWARD_COST)
                   == cut(s, cap, per_query=per_query, forward_cost=FORWARD_COST) for s in group)
        forwards = {
            "before (every device)": [len(quadratic_cut(s, cap, per_query=per_query, forward_cost=FORWARD_COST)) for s in group],
            "after, cpu": [len(cut(s, cap, per_query=per_query, forward_cost=forward_cost_on(torch.device("cpu"))))
                           for s in group],
            "after, accelerator": [len(cut(s, cap, per_query=per_query, forward_cost=forward_cost_on(torch.device("cuda"))))
                                   for s in group],
        }
        out[name] = {
            "shares": len(group), "sequences": len(group[0]), "cap": cap, "fewest": math.ceil(len(group[0]) / cap),
            "cut_ms_before": round(cut_ms(quadratic_cut, group, cap, per_query, rounds), 3),
            "cut_ms_after": round(cut_ms(cut, group, cap, per_query, rounds), 3),
            "same_cut": same,
            "forwards_per_share": {k: round(statistics.mean(v), 2) for k, v in forwards.items()},
        }
    return out


class DeviceOps(TorchDispatchMode):
    """Counts the aten ops that touch the simulated device, views aside: about one kernel launch
    each on a GPU (fused and library kernels make the count approximate)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        touched = itertools.chain(args, kwargs.values(), out if isinstance(out, (tuple, list)) else (out,))
        if not func.is_view and any(isinstance(x, SimTensor) for x in touched):
            self.count += 1
        return out


def simulated_steps(cache: Path, steps: int) -> dict:
    """The first `steps` steps on the simulated accelerator, from the same weights, under the rule
    before (FORWARD_COST there too) and after (forward_cost_on the device: the fewest forwards)."""
    out = {}
    with simulated_accelerator() as sim:
        cfg, reader, runner = setup(cache, device=sim.device)
        batches = list(stream_batches(cfg, reader, runner, steps))
        start = copy.deepcopy((runner.drafter.state_dict(), runner.optimizer.state_dict()))
        for name, forward_cost in (("before", FORWARD_COST), ("after", forward_cost_on(sim.device))):
            runner.drafter.load_state_dict(start[0])
            runner.optimizer.load_state_dict(start[1])
            runner.forward_cost = forward_cost
            fresh = copy.deepcopy(batches)
            forwards = sum(len(runner.micro_batches([(sid, seq) for sid, seq in b if seq is not None])) for b in fresh)
            sim.syncs.reset()
            with DeviceOps() as ops:
                losses = [runner.step(b, i, with_metrics=False)["local_loss"] for i, b in enumerate(fresh)]
            out[name] = {"forwards_per_step": round(forwards / steps, 2), "device_ops_per_step": round(ops.count / steps),
                         "host_syncs_per_step": round(sim.syncs.total / steps, 2), "summed_loss": round(sum(losses), 6)}
    return out


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
    parser.add_argument("--share", type=int, default=512, help="sequences of the large share whose cut is timed")
    parser.add_argument("--share-cap", type=int, default=128, help="the large share's sequences per forward at most")
    parser.add_argument("--cut-only", action="store_true",
                        help="only the cut's cost and the simulated accelerator's counts, no timed steps")
    parser.add_argument("--json", action="store_true", help="print the result as JSON, not as a table")
    args = parser.parse_args()
    at_least_one(parser, args, "steps", "rounds", "share", "share_cap")
    args.forward_costs = positive_ints(parser, "--forward-costs", args.forward_costs)
    if args.cache is not None and not (args.cache / "manifest.json").is_file():
        parser.error(f"--cache: no cache at {args.cache} (no manifest.json)")

    with tempfile.TemporaryDirectory() as tmp:
        cache = cache_or_extract(args.cache, tmp)
        cfg, reader, runner = setup(cache)
        batches = list(stream_batches(cfg, reader, runner, args.steps))
        large = list(stream_batches(cfg, reader, runner, math.ceil(args.share / cfg.schedule.batch_sequences)))
        shares = {f"tiny preset ({cfg.schedule.batch_sequences} a step, cap {runner.plan.micro})": (share_sizes(batches), runner.plan.micro),
                  f"{args.share} sequences, cap {args.share_cap}": ([sum(share_sizes(large), [])[:args.share]], args.share_cap)}
        result = {"steps": args.steps, "rounds": args.rounds, "threads": torch.get_num_threads(),
                  "batch_sequences": cfg.schedule.batch_sequences, "micro_batch_sequences": runner.plan.micro,
                  "cut": cut_cost(shares, runner.per_query, args.rounds),
                  "simulated_accelerator": simulated_steps(cache, args.steps)}
        if not args.cut_only:
            result.update(timed_steps(args, cfg, runner, batches))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    from pipeline.ui import console, key_value_table
    console.print(key_value_table("micro-batches by size", list(result.items())))


def timed_steps(args, cfg, runner, batches) -> dict:
    """Steps on the CPU from the same weights in the stream's order, cut by size at each forward
    cost and into the fewest forwards, and one sequence a micro-batch; rounds alternate."""
    start = copy.deepcopy((runner.drafter.state_dict(), runner.optimizer.state_dict()))
    micro, rule = runner.plan.micro, runner.forward_cost
    variants = {"stream_order": (True, rule, micro),
                **{f"cut_{fc}": (False, fc, micro) for fc in args.forward_costs},
                "fewest_forwards": (False, None, micro),
                "one_per_micro_batch": (True, rule, 1)}
    seconds, losses = {name: [] for name in variants}, {}
    for _ in range(args.rounds):
        for name, (stream_order, forward_cost, cap) in variants.items():
            runner.drafter.load_state_dict(start[0])
            runner.optimizer.load_state_dict(start[1])
            runner.stream_order, runner.forward_cost, runner.plan.micro = stream_order, forward_cost, cap
            fresh = copy.deepcopy(batches)
            t0 = time.perf_counter()
            out = [runner.step(b, i, with_metrics=False)["local_loss"] for i, b in enumerate(fresh)]
            seconds[name].append((time.perf_counter() - t0) / len(fresh))
            losses[name] = sum(out)
    runner.stream_order, runner.forward_cost, runner.plan.micro = False, rule, micro
    step_s = {name: statistics.median(v) for name, v in seconds.items()}
    return {"real_share": padding(batches, runner),
            "step_s": {k: round(v, 4) for k, v in step_s.items()},
            "over_stream_order": {k: round(step_s["stream_order"] / v, 2) for k, v in step_s.items()},
            "summed_loss": {k: round(v, 6) for k, v in losses.items()}}

if __name__ == "__main__":
    main()
