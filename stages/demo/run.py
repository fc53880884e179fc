"""`pipeline demo`: the whole pipeline on the embedded tiny target, end to end.

extract the cache -> verify it -> train a drafter -> evaluate it with real speculative decoding
-> write the convergence report with plots. Everything lands under one folder; re-running
resumes (committed shards are kept, training continues from its checkpoint).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pipeline.files import write_json_atomic
from pipeline.cache.manifest import read_manifest
from pipeline.config import ExtractConfig
from pipeline.embedded import TRAIN_DATA
from pipeline.records.eval_result import EvalResult, flat, variants_in
from pipeline.records.run_dir import RunDir
from pipeline.records.verify_result import VerifyResult
from pipeline.training.blocks import default_gamma
from pipeline.ui import ProgressBar, TrainView
# `pipeline demo` composes the other stages through their entry points (the one stage that may).
from stages.eval.options import EvalOptions
from stages.eval.run import run_eval
from stages.extract.run import run_extract
from stages.report.run import run_report
from stages.train.run import resolve_config, run_train
from stages.verify_cache.options import VerifyOptions
from stages.verify_cache.run import run_verify

# eval decodes 8 prompts per target pass (`eval --batch-size 8`), the variants and the greedy
# reference alike: each prompt's drafts, accepted tokens and greedy tokens are the ones it gets
# alone (tests/eval/test_eval.py), so every tau is unchanged; on 2 CPU cores the demo's eval
# is a fifth shorter (BENCHMARKS "The newcomer's hour"). The speedup over greedy is batch 8
# against batch 8 (`eval_batch_size`).
FULL = {"conversations": None, "shards": 8, "max_steps": None, "prompts": None, "budgets": [16, 64], "eval_batch": 8}
QUICK = {"conversations": 160, "shards": 2, "max_steps": 40, "prompts": 6, "budgets": [4], "eval_batch": 8}


def run_demo(out: Path, *, quick: bool, progress: bool = True, say=print, report_to: str | None = None,
             block_size: int | None = None) -> dict:
    plan = QUICK if quick else FULL
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    timings, t0 = {}, time.perf_counter()
    data = str(TRAIN_DATA)
    if plan["conversations"]:
        rows = TRAIN_DATA.read_text(encoding="utf-8").splitlines()[:plan["conversations"]]
        (out / "conversations.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
        data = str(out / "conversations.jsonl")

    say(f"[1/5] extract: the embedded target over {plan['conversations'] or 1000} conversations -> {out / 'cache'}")
    start = time.perf_counter()
    run_extract(ExtractConfig(cache=str(out / "cache"), data=[data], num_shards=plan["shards"]), None, progress=progress)
    timings["extract_s"] = time.perf_counter() - start
    manifest = read_manifest(out / "cache")
    tokens = sum(r.tokens for r in manifest.shards.values())
    stored = sum(r.bytes for r in manifest.shards.values())

    say("[2/5] verify-cache")
    start = time.perf_counter()
    verified = run_verify(VerifyOptions(cache=str(out / "cache")), progress=progress)
    timings["verify_s"] = time.perf_counter() - start
    failed = VerifyResult.from_json(verified).with_status("fail")

    say("[3/5] train: the tiny preset" + (f", block {block_size}" if block_size else "")
        + (f", {plan['max_steps']} steps" if plan["max_steps"] else ", 6 epochs"))
    start = time.perf_counter()
    overrides = {"cache": str(out / "cache"), "out": str(out / "run"), "max_steps": plan["max_steps"],
                 "report_to": report_to, "block_size": block_size,
                 # the preset's gamma is its block 8's: another block size takes DESIGN's gamma for it
                 "gamma": default_gamma(block_size) if block_size else None}
    cfg, preset_target = resolve_config(None, overrides)
    trained = run_train(cfg, preset_target=preset_target, view=TrainView(progress), warn=say)
    timings["train_s"] = time.perf_counter() - start

    say(f"[4/5] eval: speculative decoding on {plan['prompts'] or 200} held-out prompts (block, DDTree "
        f"{', '.join(map(str, plan['budgets']))})")
    start = time.perf_counter()
    with ProgressBar("eval", "prompts", total=plan["prompts"] or 200, enabled=progress) as bar:
        evaluated = run_eval(EvalOptions(drafter=out / "run", tree_budget=plan["budgets"], limit=plan["prompts"],
                                         batch_size=plan["eval_batch"]), progress=bar.advance)
    timings["eval_s"] = time.perf_counter() - start
    (out / "eval.json").write_text(json.dumps(evaluated, indent=2) + "\n")

    say("[5/5] report")
    start = time.perf_counter()
    reported = run_report([out / "run"], window_size=None, every=None, epochs=None, steps_per_epoch=None,
                          reference_tau=None, plots=out / "report", eval_file=out / "eval.json")
    timings["report_s"] = time.perf_counter() - start
    (out / "report.json").write_text(json.dumps(reported, indent=2, default=str) + "\n")
    timings["total_s"] = time.perf_counter() - t0

    last = trained["last"]
    ev = EvalResult.from_json(evaluated)
    blocks = [(v, f) for v, f in ev.variants.items() if v.name == "block"]
    summary = {
        "out": str(out),
        "cache": {"path": str(out / "cache"), "tokens": tokens, "bytes": stored, "bytes_per_token": stored / max(tokens, 1),
                  "shards": len(manifest.shards)},
        "verify": {"passed": verified["passed"], "failed_checks": failed},
        "train": {"steps": trained["steps"], "block_size": cfg.drafter.block_size, **{k: last.get(k) for k in ("loss", "accuracy", "top4_acc", "avg_streak",
                                                                           "ddtree_streak8")},
                  "drafter": trained["drafter"], "log": str(RunDir(out / "run").train_log)},
        "eval": {"prompts": ev.prompts, "lossless": ev.lossless,
                 **flat(blocks, "tau_mean_of_means"), **flat(ev.variants.items(), "tau_pooled"),
                 "block_speedup_vs_greedy_cpu": blocks[0][1]["speedup_vs_greedy"], "eval_batch_size": ev.batch_size,
                 "tree_verify": ev.tree_verify, "tree_verify_reason": ev.tree_verify_reason,
                 "by_kind": kind_taus(ev.by_kind)},
        "report": {"plots": reported.get("plots", []),
                   "verdicts": {m: v.get("verdict") for m, v in reported["runs"][0]["verdicts"].items()}},
        "timings": timings,
    }
    write_json_atomic(out / "demo.json", summary)
    return summary


def kind_taus(by_kind: dict) -> dict:
    """eval's per-kind figures cut to what the demo shows: {kind: {prompts, block_tau_pooled,
    ddtree<budget>_tau_pooled}} (thinking, non-thinking and tool-call turns)."""
    return {kind: {"prompts": g["prompts"], **flat(variants_in(g), "tau_pooled")} for kind, g in by_kind.items()}
