"""Projected taps on the embedded target: the energy a projection to R values a token keeps and the
acceptance length (tau) a drafter trained on it reaches, against the full taps, in bf16 and fp8.

    python benchmarks/training/projected_tau.py --work DIR [--formats bf16,fp8] [--ranks full,192,128,96,64]
        [--seeds 0] [--extra-seeds 1,2] [--close 0.1] [--rows 400] [--shards 2] [--pilot-tokens 32768]
        [--steps 250] [--prompts 64] [--max-new-tokens 64] [--tree-budget 16,64] [--batch-size 16]
        [--projected-fc energy]

The embedded tiny target's taps are 3 x 128 = 384 values a token ("full"). For each hidden format
and R: `pipeline extract` of the first `--rows` embedded training conversations in `--shards`
shards (`--project-taps R --pilot-tokens N`; none for full), once, shared by every seed. For each
seed: `pipeline train` (the tiny preset, `--steps` steps, `--seed S`) on that cache, then
`pipeline eval` (greedy, the live target; block and DDTree at each `--tree-budget`) on the first
`--prompts` held-out prompts with `--max-new-tokens`, `--batch-size` prompts decoded together
(the same tokens and taus as one at a time: each prompt is checked against its own greedy tokens;
on this 2-core machine 30 s instead of 10 minutes): the pooled tau of each variant and whether
every output was greedy's (lossless). Energy: the manifest's capture.projection.energy, the share
of the pilot's energy (sum of squares) the R components keep (1 for full); beside it, what
`pipeline cache-info --energy` reads from the full cache's first N tokens at each R.

`--projected-fc` is train's: how fc' reads the stored components ('energy', the default since
issue 77: at each component's pilot RMS, fc' initialised as a whole-tap fc restricted to the basis;
'unit': as stored, the first form). A projected run's files carry the form in their names
(result-FMT-R-FORM-sS.json); full taps have none, so two invocations on one --work share them.

Seeds: every config runs `--seeds`; then each config whose block tau (mean over those seeds) is
within `--close` of full's at the same format, full itself and the best projected config of each
format also run `--extra-seeds` (`--extra-seeds ''`: none). Rows give the mean over the seeds run
and the per-seed values.

Resumable: a config's caches, runs and results stay in --work (result-FMT-R-sS.json); a rerun
skips every result that exists (extract and train resume theirs). Prints one JSON document on
stdout, then a markdown table; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.cli_args import at_least_one, positive_ints  # noqa: E402

FULL = "full"


def _cli(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pipeline {' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return done


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_data(work: Path, rows: int) -> Path:
    from harness.runs import write_rows
    from pipeline.embedded import TRAIN_DATA

    data = work / "convs.jsonl"
    if not data.is_file():
        convs = [json.loads(line) for line in TRAIN_DATA.read_text().splitlines() if line.strip()][:rows]
        write_rows(work / "convs.jsonl.partial", convs).rename(data)
    return data


def ensure_cache(work: Path, data: Path, fmt: str, projected_rank, args) -> dict:
    """The cache of (fmt, projected_rank), extracted unless complete; {cache, energy, rank (R or "full"), extract_s}."""
    cache = work / f"cache-{fmt}-{projected_rank}"
    info_file = work / f"cache-{fmt}-{projected_rank}.json"
    if info_file.is_file():
        return json.loads(info_file.read_text())
    start = time.perf_counter()
    _cli("extract", "--data", str(data), "--cache", str(cache), "--num-shards", str(args.shards), "--hidden-format", fmt,
         *([] if projected_rank == FULL else ["--project-taps", str(projected_rank), "--pilot-tokens", str(args.pilot_tokens)]), "--json")
    extract_s = time.perf_counter() - start
    projected_ranks = [r for r in args.ranks if r != FULL] if projected_rank == FULL else []
    doc = json.loads(_cli("cache-info", str(cache), "--json",
                          *(["--energy", ",".join(map(str, projected_ranks)), "--energy-tokens", str(args.pilot_tokens)]
                            if projected_ranks else [])).stdout)
    projection = doc["identity"]["capture"].get("projection")
    info = {"cache": str(cache), "rank": projected_rank, "format": fmt, "extract_s": round(extract_s, 1),
            "tokens": doc["counts"]["tokens"], "stored_bytes": doc["bytes"]["stored"],
            "energy": 1.0 if projection is None else projection["energy"],
            "pilot_tokens": None if projection is None else projection["pilot_tokens"]}
    if projected_ranks:
        info["cache_info_energy"] = doc.get("energy")
    info_file.write_text(json.dumps(info, indent=2) + "\n")
    _log(f"cache {fmt} R={projected_rank}: {json.dumps(info)}")
    return info


def ensure_result(work: Path, cache: dict, fmt: str, projected_rank, seed: int, args) -> dict:
    """Train and eval (fmt, projected_rank, seed) unless its result exists."""
    from pipeline.records.eval_result import variants_in

    name = f"{fmt}-{projected_rank}" if projected_rank == FULL else f"{fmt}-{projected_rank}-{args.projected_fc}"
    out = work / f"result-{name}-s{seed}.json"
    settings = {"steps": args.steps, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                "tree_budget": args.tree_budget, "pilot_tokens": args.pilot_tokens, "rows": args.rows, "shards": args.shards}
    if out.is_file():
        done = json.loads(out.read_text())
        if done.get("settings") != settings:
            raise SystemExit(f"{out} was measured with {done.get('settings')}, not {settings}: use another --work")
        return done
    run = work / f"run-{name}-s{seed}"
    start = time.perf_counter()
    _cli("train", "--cache", cache["cache"], "--out", str(run), "--max-steps", str(args.steps), "--log-every", "10",
         "--seed", str(seed), *([] if projected_rank == FULL else ["--projected-fc", args.projected_fc]))
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    ev = json.loads(_cli("eval", "--drafter", str(run), "--limit", str(args.prompts), "--max-new-tokens",
                         str(args.max_new_tokens), "--tree-budget", ",".join(map(str, args.tree_budget)),
                         "--batch-size", str(args.batch_size), "--json").stdout)
    eval_s = time.perf_counter() - start
    (work / f"eval-{name}-s{seed}.json").write_text(json.dumps(ev, indent=2) + "\n")
    last = json.loads((run / "train_log.jsonl").read_text().splitlines()[-1])
    taus = {v.name: round(float(figures["tau_pooled"]), 4) for v, figures in variants_in(ev, strict=True)}
    result = {"format": fmt, "rank": projected_rank, "projected_fc": None if projected_rank == FULL else args.projected_fc, "seed": seed, "settings": settings, "energy": cache["energy"], "tau": taus,
              "lossless": ev["lossless"], "prompts": ev["prompts"], "loss_last_log": last.get("loss"),
              "accuracy_last_log": last.get("accuracy"), "train_s": round(train_s, 1), "eval_s": round(eval_s, 1)}
    out.write_text(json.dumps(result, indent=2) + "\n")
    _log(f"result {fmt} R={projected_rank} seed {seed}: {json.dumps(result)}")
    return result


def _mean(values: list[float]) -> float:
    return round(statistics.fmean(values), 3)


def summarise(rows_by_config: dict, caches: dict, args) -> list[dict]:
    table = []
    for (fmt, projected_rank), results in rows_by_config.items():
        results = sorted(results, key=lambda r: r["seed"])
        names = list(results[0]["tau"])
        row = {"format": fmt, "rank": projected_rank, "energy": round(caches[fmt, projected_rank]["energy"], 4),
               "seeds": [r["seed"] for r in results],
               "tau_mean": {n: _mean([r["tau"][n] for r in results]) for n in names},
               "tau_per_seed": {n: [r["tau"][n] for r in results] for n in names},
               "lossless": all(r["lossless"] for r in results)}
        if len(results) > 1:
            row["tau_stdev"] = {n: round(statistics.stdev([r["tau"][n] for r in results]), 3) for n in names}
        table.append(row)
    for row in table:
        full = next((f for f in table if f["format"] == row["format"] and f["rank"] == FULL), None)
        if full:
            row["tau_vs_full"] = {n: round(row["tau_mean"][n] - full["tau_mean"][n], 3) for n in row["tau_mean"]}
    return table


def second_round(table: list[dict], args) -> set:
    """The configs that also run --extra-seeds: full, the best projected one per format, and any
    whose block tau is within --close of full's at the same format."""
    chosen = set()
    for fmt in args.formats:
        mine = [r for r in table if r["format"] == fmt]
        full = next((r for r in mine if r["rank"] == FULL), None)
        projected = [r for r in mine if r["rank"] != FULL]
        if full:
            chosen.add((fmt, FULL))
        if projected:
            chosen.add((fmt, max(projected, key=lambda r: r["tau_mean"]["block"])["rank"]))
        if full:
            chosen |= {(fmt, r["rank"]) for r in projected
                       if abs(r["tau_mean"]["block"] - full["tau_mean"]["block"]) <= args.close}
    return chosen


def markdown(table: list[dict], args) -> str:
    names = list(table[0]["tau_mean"]) if table else []
    labels = {"block": "block tau", **{f"tree{b}": f"DDTree{b} tau" for b in args.tree_budget}}
    lines = ["| format | R | energy | " + " | ".join(labels.get(n, n) for n in names) + " | lossless | seeds |",
             "|" + "---|" * (len(names) + 5)]
    for row in table:
        cells = []
        for n in names:
            per = row["tau_per_seed"][n]
            cell = f"{row['tau_mean'][n]:.2f}"
            if len(per) > 1:
                cell += " (" + ", ".join(f"{v:.2f}" for v in per) + ")"
            cells.append(cell)
        lines.append(f"| {row['format']} | {row['rank']} | {row['energy']:.4f} | " + " | ".join(cells)
                     + f" | {'yes' if row['lossless'] else 'NO'} | {','.join(map(str, row['seeds']))} |")
    return "\n".join(lines)


def seeds(parser: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    """Comma-separated seeds >= 0, at least one."""
    values = [v.strip() for v in text.split(",")]
    if not all(v.isdigit() for v in values):
        parser.error(f"{option} must be comma-separated integers >= 0, got {text!r}")
    return [int(v) for v in values]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True, help="Folder for the data, caches, runs and results (reused: resumable).")
    p.add_argument("--formats", default="bf16,fp8", help="Hidden formats, comma-separated (default bf16,fp8).")
    p.add_argument("--ranks", default="full,192,128,96,64", help="Projected widths R, comma-separated; 'full': the taps whole.")
    p.add_argument("--seeds", default="0", help="Training seeds every config runs (default 0).")
    p.add_argument("--extra-seeds", default="1,2", help="Seeds the close configs also run ('' for none; default 1,2).")
    p.add_argument("--close", type=float, default=0.1, help="Block tau within this of full's at the same format: close (default 0.1).")
    p.add_argument("--rows", type=int, default=400, help="Embedded training conversations extracted (default 400).")
    p.add_argument("--shards", type=int, default=2, help="Shards of each cache (default 2).")
    p.add_argument("--pilot-tokens", type=int, default=32_768, help="extract --pilot-tokens (default 32,768).")
    p.add_argument("--steps", type=int, default=250, help="Training steps of each run (default 250).")
    p.add_argument("--prompts", type=int, default=64, help="Held-out prompts evaluated (default 64).")
    p.add_argument("--max-new-tokens", type=int, default=64, help="eval --max-new-tokens (default 64).")
    p.add_argument("--tree-budget", default="16,64", help="eval --tree-budget (default 16,64).")
    p.add_argument("--batch-size", type=int, default=16, help="eval --batch-size (default 16).")
    p.add_argument("--projected-fc", default="energy", choices=["energy", "unit"],
                   help="train --projected-fc for the projected ranks (default energy).")
    args = p.parse_args()
    if set(args.formats.split(",")) - {"bf16", "fp8"} or not args.formats:
        p.error(f"--formats takes bf16 and fp8, got {args.formats!r}")
    args.formats = args.formats.split(",")
    projected_ranks = [r for r in args.ranks.split(",") if r != FULL]
    args.ranks = ([FULL] if FULL in args.ranks.split(",") else []) + \
        (positive_ints(p, "--ranks", ",".join(projected_ranks)) if projected_ranks else [])
    args.seeds = seeds(p, "--seeds", args.seeds)
    args.extra_seeds = seeds(p, "--extra-seeds", args.extra_seeds) if args.extra_seeds else []
    args.tree_budget = positive_ints(p, "--tree-budget", args.tree_budget)
    at_least_one(p, args, "rows", "shards", "pilot_tokens", "steps", "prompts", "max_new_tokens", "batch_size")

    started = time.perf_counter()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = ensure_data(work, args.rows)
    caches, results = {}, {}
    for fmt in args.formats:
        for projected_rank in args.ranks:
            caches[fmt, projected_rank] = ensure_cache(work, data, fmt, projected_rank, args)
            for seed in args.seeds:
                results.setdefault((fmt, projected_rank), []).append(
                    ensure_result(work, caches[fmt, projected_rank], fmt, projected_rank, seed, args))
    extra = sorted(second_round(summarise(results, caches, args), args), key=lambda c: (c[0], str(c[1])))
    for fmt, projected_rank in extra:
        for seed in args.extra_seeds:
            if seed not in args.seeds:
                results[fmt, projected_rank].append(ensure_result(work, caches[fmt, projected_rank], fmt, projected_rank, seed, args))
    table = summarise(results, caches, args)
    doc = {"benchmark": "projected_tau", "projected_fc": args.projected_fc, "rows": args.rows, "shards": args.shards, "pilot_tokens": args.pilot_tokens,
           "steps": args.steps, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
           "tree_budget": args.tree_budget, "seeds": args.seeds, "extra_seeds": args.extra_seeds, "close": args.close,
           "extra_seed_configs": [list(c) for c in extra],
           "caches": [caches[k] | {"cache": Path(caches[k]["cache"]).name} for k in caches],
           "table": table, "runs": [r for rs in results.values() for r in rs],
           "wall_s_this_invocation": round(time.perf_counter() - started, 1)}
    print(json.dumps(doc, indent=2))
    print()
    print(markdown(table, args))


if __name__ == "__main__":
    main()
