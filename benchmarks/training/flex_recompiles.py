"""How many graphs torch compiles for the drafter's flex attention over a run's changing shapes
(issue 67): compiled as before issue 67 (the kernel with `dynamic=False`, the mask with dynamo's
defaults) and as the model compiles both now (`pipeline.drafter.attention_rule._compiled_flex`:
dynamic shapes), on the CPU.

    python benchmarks/training/flex_recompiles.py [--shapes 10] [--backend aot_eager] [--backward] [--json]

Every training step packs its own micro-batch: its sequences (S), context length (T) and anchors
(A, so A x 16 queries) differ from the last step's. This runs `--shapes` such micro-batches (seeded;
S from 1 to 4, T from 128 to 1,024 tokens, A from 8 to 48, a sliding-window layer kind and a full
one, as the flagship has) through `flex_attention(..., compiled=True)` and reports, after each, the
graphs compiled so far for the mask's creation (`create_block_mask`) and for the kernel
(`flex_attention`), how many of the two have reached dynamo's recompile limit (8 graphs; from then
on every new shape runs uncompiled, and uncompiled flex attention is unfused: every [Q, T + Q] score
materialised), and the largest difference from
`split_block_attention` (outputs; with `--backward` also the q/k/v gradients, through
harness/flex_cpu_backward.py).

The backend: "aot_eager" (default) traces as inductor does and decides recompiles by the same
guards, and runs on any CPU. "inductor" on the CPU compiles static shapes but fails on dynamic ones
(a C++ compile error in torch 2.13's CPU flex template) and has no backward (pytorch #148752): what
it prints then is the first line of the error. A GPU's count: benchmarks/gpu/gpu_check.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
from torch._dynamo.eval_frame import _debug_get_cache_entry_list as cache_entries
from torch.nn.attention import flex_attention as fa

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.cli_args import at_least_one  # noqa: E402
from harness.flex_cpu_backward import flex_backward_on_cpu  # noqa: E402
from pipeline.drafter import attention_rule  # noqa: E402

BLOCK, HEADS, KV_HEADS, DIM, WINDOW = 16, 4, 2, 16, 64


def shapes(n: int, seed: int = 0) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(1, 4), rng.randint(128, 1024), rng.randint(8, 48)) for _ in range(n)]


class LimitHits(logging.Handler):
    """Counts dynamo's "hit config.recompile_limit" warnings: one per function that reached the
    limit, from then on compiled for no new shape (each runs uncompiled)."""

    def __init__(self):
        super().__init__()
        self.hits = 0

    def emit(self, record):
        if "recompile_limit" in record.getMessage():
            self.hits += 1


def graphs() -> dict[str, int]:
    """Compiled graphs held now for each of the two functions (dynamo's cache entries)."""
    return {"create_block_mask": len(cache_entries(fa.create_block_mask.__code__)),
            "flex_attention": len(cache_entries(fa.flex_attention.__code__))}


def run(mode: str, backend: str, run_shapes, backward: bool) -> dict:
    torch._dynamo.reset()
    attention_rule._compiled_flex.cache_clear()
    original = attention_rule._compiled_flex
    if mode == "before":
        # The code before issue 67: `create_block_mask(..., _compile=True)` is torch.compile with
        # dynamo's defaults, and the kernel was compiled with dynamic=False.
        pair = (torch.compile(fa.create_block_mask, backend=backend),
                torch.compile(fa.flex_attention, dynamic=False, backend=backend))
        attention_rule._compiled_flex = lambda backend: pair
    hits = LimitHits()
    logging.getLogger("torch._dynamo").addHandler(hits)
    rows, start = [], time.perf_counter()
    try:
        with flex_backward_on_cpu() if backward else contextlib.nullcontext():
            for i, (s, t, a) in enumerate(run_shapes):
                g = torch.Generator().manual_seed(i)
                anchors = torch.sort(torch.randint(1, t + 1, (s, a), generator=g), dim=1).values
                q = torch.randn(s, HEADS, a * BLOCK, DIM, generator=g, requires_grad=backward)
                k = torch.randn(s, KV_HEADS, t + a * BLOCK, DIM, generator=g, requires_grad=backward)
                v = torch.randn(s, KV_HEADS, t + a * BLOCK, DIM, generator=g, requires_grad=backward)
                attend = attention_rule.flex_attention(anchors, t, a * BLOCK, {None, WINDOW}, compiled=True, backend=backend)
                diff = 0.0
                for window in (WINDOW, None):
                    with torch.set_grad_enabled(backward):
                        got, want = attend(q, k, v, window), attention_rule.split_block_attention(q, k, v, t, anchors, window)
                    diff = max(diff, float((got - want).abs().max()))
                    if backward:
                        up = torch.randn(got.shape, generator=g)
                        for x, y in zip(torch.autograd.grad(got, (q, k, v), up), torch.autograd.grad(want, (q, k, v), up)):
                            diff = max(diff, float((x - y).abs().max()))
                rows.append({"sequences": s, "tokens": t, "anchors": a, **graphs(), "past_recompile_limit": hits.hits,
                             "max_abs_diff_vs_split": diff})
    except Exception as e:  # noqa: BLE001 - inductor's CPU failures are a result here, reported in one line
        rows.append({"failed": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"})
    finally:
        logging.getLogger("torch._dynamo").removeHandler(hits)
        attention_rule._compiled_flex = original
        attention_rule._compiled_flex.cache_clear()
        torch._dynamo.reset()
    return {"mode": mode, "seconds": round(time.perf_counter() - start, 1), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=int, default=10, help="micro-batch shapes to run (default 10)")
    parser.add_argument("--backend", default="aot_eager", choices=["eager", "aot_eager", "inductor"],
                        help="torch.compile backend (default aot_eager; inductor: see above)")
    parser.add_argument("--backward", action="store_true", help="also the gradients (harness/flex_cpu_backward.py)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    at_least_one(parser, args, "shapes")
    run_shapes = shapes(args.shapes)
    results = [run(mode, args.backend, run_shapes, args.backward) for mode in ("before", "now")]
    if args.json:
        print(json.dumps({"torch": torch.__version__, "backend": args.backend, "backward": args.backward,
                          "results": results}, indent=1))
        return
    print(f"torch {torch.__version__}, backend {args.backend}, {'forward and backward' if args.backward else 'forward'}")
    for result in results:
        print(f"\n{result['mode']} ({result['seconds']} s)")
        print(f"{'S':>2} {'T':>5} {'A':>3}  {'mask graphs':>11} {'kernel graphs':>13} {'past limit':>10}  max |flex - split|")
        for r in result["rows"]:
            if "failed" in r:
                print(f"  failed: {r['failed']}")
                continue
            print(f"{r['sequences']:>2} {r['tokens']:>5} {r['anchors']:>3}  {r['create_block_mask']:>11} "
                  f"{r['flex_attention']:>13} {r['past_recompile_limit']:>10}  {r['max_abs_diff_vs_split']:.1e}")


if __name__ == "__main__":
    main()
