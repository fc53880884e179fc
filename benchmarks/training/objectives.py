"""Which objective gives the best drafter (issue 42): the same steps, seeds and data for each
(objective, slot weights) variant at block 8 and 16; held-out tau greedy and sampled (block and
DDTree), teacher-forced avg_streak on the held-out conversations, wall time per step.

    python benchmarks/training/objectives.py --work W [--steps 150] [--prompts 32] [--seeds 0,1,2]
        [--blocks 8,16] [--shard I/N] [--table]

Each cell (block, variant, seed) trains a drafter from one cache of the embedded target's
training conversations, then runs `pipeline eval` on the first --prompts held-out prompts twice:
greedy and at temperature 0.7 / top-p 0.95 (seed 0). A cell's figures go to W/cells/*.json as
soon as it is done, so the run resumes, and `--shard I/N` splits the cells between N processes
(one torch thread each) on one machine. `--table` prints the table from the cells done.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from pipeline.records.run_dir import RunDir  # noqa: E402
from pipeline.records.train_log import read_train_log  # noqa: E402

VARIANTS = {   # name: (loss, position_weight)
    "ce + decay (today)": ("ce", "decay"),
    "ce + dpace": ("ce", "dpace"),
    "kl + decay": ("kl", "decay"),
    "lk + dpace": ("lk", "dpace"),
    "tv + dpace": ("tv", "dpace"),
}
SAMPLED = dict(temperature=0.7, top_p=0.95, top_k=0, seed=0)


def caches(work: Path) -> tuple[Path, Path, Path]:
    """(training cache, held-out cache, held-out conversations), extracted once."""
    from pipeline.config import ExtractConfig
    from pipeline.embedded import HELDOUT_DATA, TRAIN_DATA
    from stages.extract.run import run_extract

    out = []
    for name, data in (("train", TRAIN_DATA), ("heldout", HELDOUT_DATA)):
        cache = work / f"{name}-cache"
        if not (cache / "manifest.json").exists() or not list(cache.glob("shard-*/digests.json")):
            run_extract(ExtractConfig(cache=str(cache), data=[str(data)], num_shards=4), None, progress=False)
        out.append(cache)
    return out[0], out[1], HELDOUT_DATA


def cell_name(block: int, variant: str, seed: int) -> str:
    slug = variant.split(" (")[0].replace(" + ", "-").replace(" ", "")
    return f"b{block}-{slug}-s{seed}"


def run_cell(work: Path, block: int, variant: str, seed: int, steps: int, prompts: int) -> dict:
    from stages.eval.options import EvalOptions
    from stages.eval.run import run_eval
    from stages.train.run import resolve_config, run_train

    train_cache, heldout_cache, heldout = caches(work)
    loss, weight = VARIANTS[variant]
    out = work / "runs" / cell_name(block, variant, seed)
    cfg, preset_target = resolve_config(None, {"cache": str(train_cache), "out": str(out), "max_steps": steps,
                                               "block_size": block, "loss": loss, "position_weight": weight,
                                               "seed": seed, "log_every": 10})
    trained = run_train(cfg, preset_target=preset_target, warn=lambda *_: None)
    lines = [line.to_json() for line in read_train_log(RunDir(out).train_log)]
    evals = {}
    for mode, sampling in (("greedy", {}), ("sampled", SAMPLED)):
        t0 = time.perf_counter()
        result = run_eval(EvalOptions(drafter=out, target=None, prompts=heldout, max_new_tokens=96, block_size=None,
                                      tree_budget=[16], tree_top_k=8, limit=prompts,
                                      cache=heldout_cache if mode == "greedy" else None,
                                      batch_size=8, **sampling))
        evals[mode] = {"block_pooled": result["block"]["tau_pooled"], "block_mean_of_means": result["block"]["tau_mean_of_means"],
                       "tree16_pooled": result["tree"]["16"]["tau_pooled"],
                       "tree16_mean_of_means": result["tree"]["16"]["tau_mean_of_means"], "eval_s": time.perf_counter() - t0}
        if mode == "greedy":
            evals["lossless"] = result["lossless"]
            evals["teacher_forced_avg_streak"] = result["teacher_forced"]["avg_streak"]
    # Wall time per step: the log's elapsed time between its first and last lines (no export, no
    # loading), over the steps between them.
    per_step = (lines[-1]["elapsed_s"] - lines[0]["elapsed_s"]) / max(lines[-1]["step"] - lines[0]["step"], 1)
    return {"block": block, "variant": variant, "seed": seed, "steps": trained["steps"], "wall_s_per_step": per_step,
            "train_avg_streak_last": lines[-1]["avg_streak"], **evals}


def table(cells: list[dict]) -> str:
    """Mean over seeds, with the spread (max - min) in brackets."""
    def fmt(values):
        return f"{statistics.mean(values):.3f} [{max(values) - min(values):.3f}]" if values else "-"
    columns = [("greedy block pooled", lambda c: c["greedy"]["block_pooled"]),
               ("greedy block mean of means", lambda c: c["greedy"]["block_mean_of_means"]),
               ("greedy DDTree16 pooled", lambda c: c["greedy"]["tree16_pooled"]),
               ("T0.7 block pooled", lambda c: c["sampled"]["block_pooled"]),
               ("T0.7 block mean of means", lambda c: c["sampled"]["block_mean_of_means"]),
               ("T0.7 DDTree16 pooled", lambda c: c["sampled"]["tree16_pooled"]),
               ("teacher-forced avg_streak", lambda c: c["teacher_forced_avg_streak"]),
               ("s/step", lambda c: c["wall_s_per_step"])]
    rows = ["| block | variant | seeds | " + " | ".join(name for name, _ in columns) + " |",
            "|" + "---|" * (3 + len(columns))]
    for block in sorted({c["block"] for c in cells}):
        for variant in VARIANTS:
            mine = [c for c in cells if c["block"] == block and c["variant"] == variant]
            if mine:
                rows.append(f"| {block} | {variant} | {len(mine)} | " + " | ".join(fmt([get(c) for c in mine]) for _, get in columns) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the cache, runs and cells/*.json (reused on rerun)")
    parser.add_argument("--steps", type=int, default=150, help="training steps per cell")
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts each cell is decoded on")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    parser.add_argument("--blocks", default="8,16", help="comma-separated block sizes")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from VARIANTS")
    parser.add_argument("--shard", default="0/1", help="I/N: this process runs every N-th cell from the I-th")
    parser.add_argument("--table", action="store_true", help="print the table of the cells done, run nothing")
    args = parser.parse_args()
    (args.work / "cells").mkdir(parents=True, exist_ok=True)
    if not args.table:
        torch.set_num_threads(1)
        index, count = (int(x) for x in args.shard.split("/"))
        grid = [(b, v, s) for s in (int(x) for x in args.seeds.split(",")) for b in (int(x) for x in args.blocks.split(","))
                for v in args.variants.split(",")]
        for block, variant, seed in grid[index::count]:
            path = args.work / "cells" / f"{cell_name(block, variant, seed)}.json"
            if path.exists():
                continue
            t0 = time.perf_counter()
            cell = run_cell(args.work, block, variant, seed, args.steps, args.prompts)
            cell["cell_s"] = time.perf_counter() - t0
            path.write_text(json.dumps(cell, indent=2) + "\n")
            print(f"{path.name}: greedy block {cell['greedy']['block_pooled']:.2f}, sampled block "
                  f"{cell['sampled']['block_pooled']:.2f} ({cell['cell_s']:.0f} s)", flush=True)
    cells = [json.loads(p.read_text()) for p in sorted((args.work / "cells").glob("*.json"))]
    print(table(cells))


if __name__ == "__main__":
    main()
