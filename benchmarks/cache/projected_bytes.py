"""Bytes per token of a projected cache at the flagship width, and what the projection costs in
extract time: `extract --project-taps R` against the whole taps, on a CPU.

    python benchmarks/cache/projected_bytes.py [--layers 8] [--longest 3000] [--span 6000]
                                               [--ranks 5120,2560] [--num-shards 1] [--threads 2]
                                               [--work DIR] [--keep]

What runs, each a real CLI subprocess, one at a time, all at tp 1 into directories, compute in
bf16 (`compute_dtype = "bfloat16"` in an [extract] table), the same rows for all:
1. The target of the flagship rehearsal (benchmarks/flagship/rehearsal.py): Qwen3.6-27B's text
   config cut to `--layers` (hidden 5120, 5 taps: 25,600 values a token), random bf16 weights,
   the real Qwen3.6 tokenizer and chat template from the shared fixtures (REPO/../shared/fixtures).
   Reused when `--work` holds it already.
2. Data: agent sessions from the rehearsal's `write_data` (a system prompt with tools, then
   requests answered with reasoning, tool calls and tool replies) of about 570 to `--longest`
   tokens, as many rows as it takes for the pilot to span `--span` directions. Every session
   opens with the same system prompt and tools (about 350 tokens), and a causal target gives a
   repeated prefix the same taps, so a pilot spans at most its distinct prefixes, not its tokens:
   4 rows of 570 to 3,105 tokens (7,123 tokens, 6,072 distinct prefixes) where R = 5120 needs
   more than 5,120 (the fit refuses an R beyond what the pilot spans).
3. `extract`: bf16 whole taps; fp8 whole taps; fp8 + `--project-taps R` for each R of `--ranks`
   with `--pilot-tokens` = every token of the data (the pilot is the data itself: a second pass
   over it before the extraction pass).
4. `cache-info CACHE --json` on each.

Prints one JSON document: the machine (pipeline/timing_machine.py), the data (rows, tokens, distinct
prefixes), and per run: the command, its wall seconds, peak RSS and peak anonymous memory of the
extract process (benchmarks/process_memory.py), the 1-minute load average before and after it (the
machine is shared), stored bytes per token (cache-info), raw bytes per token (the schema's,
before compression), the tap arrays' stored bytes per token (`hidden` and `hidden_scale` on disk)
and the rest, the basis file's bytes (a projected cache's one constant, not in the per-token
count), the pilot's seconds (its forwards, the basis fit and the store), the energy the R
components keep on the pilot, and the ratios: stored bytes to bf16 whole taps, extract wall time
to fp8 whole taps (whole command, and the extraction pass alone: extract's seconds less the
pilot's). Random weights: the energy says nothing about a trained target's taps. Deletes the
target and the caches at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.flagship.rehearsal import FIXTURES, Rehearsal, write_data  # noqa: E402
from pipeline.cache.schema import HIDDEN, HIDDEN_SCALE  # noqa: E402
from pipeline.timing_machine import describe_machine, machine_line  # noqa: E402


def session_ids(path: Path, target: Path) -> list[list[int]]:
    """Each row's token ids as extract renders them (the target's tokenizer and template, thinking on)."""
    from transformers import AutoTokenizer

    from pipeline.data.conversations import parse_row
    from pipeline.data.loss_mask import ConversationMasker

    masker = ConversationMasker(AutoTokenizer.from_pretrained(target), "<|im_end|>", {"enable_thinking": True})
    out = []
    for k, line in enumerate(path.read_text().splitlines()):
        row = parse_row(k, str(path), json.loads(line))
        out.append(list(masker(row.messages, tools=row.tools, where=str(path)).input_ids))
    return out


def distinct_prefixes(rows: list[list[int]]) -> int:
    """Positions whose whole prefix no earlier position had: the most directions a causal
    target's taps over these rows can span."""
    root: dict = {}
    count = 0
    for ids in rows:
        node = root
        for token in ids:
            if token not in node:
                node[token] = {}
                count += 1
            node = node[token]
    return count


def write_rows(path: Path, target: Path, longest: int, span: int, most: int = 64) -> dict:
    """The fewest rows (at least 2) of `write_data` whose distinct prefixes reach `span`."""
    for rows in range(2, most + 1):
        write_data(path, rows, target, longest)
        ids = session_ids(path, target)
        distinct = distinct_prefixes(ids)
        if distinct >= span:
            return {"rows": rows, "tokens_per_row": [len(i) for i in ids], "tokens": sum(len(i) for i in ids),
                    "distinct_prefixes": distinct, "longest": longest}
    raise SystemExit(f"{most} rows of at most {longest} tokens span fewer than {span} directions")


def tap_bytes(cache: Path) -> int:
    """Bytes on disk of the tap arrays (hidden, and fp8's hidden_scale) of every shard."""
    return sum(f.stat().st_size for shard in cache.glob("shard-*") for name in (HIDDEN, HIDDEN_SCALE)
               for f in (shard / name).rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="target depth (8: the least whose 5 default taps are distinct)")
    parser.add_argument("--hidden", type=int, default=None,
                        help="a smoke test of this script: the random target of pipeline.toy.random_target at this "
                             "width (8 layers, the real vocabulary) instead of the flagship's 5120")
    parser.add_argument("--longest", type=int, default=3000, help="tokens of the longest session (about)")
    parser.add_argument("--span", type=int, default=6000,
                        help="rows are added until the data's distinct prefixes reach this (more than the largest R)")
    parser.add_argument("--ranks", default="5120,2560", help="comma-separated R of the projected runs")
    parser.add_argument("--num-shards", type=int, default=1, help="shards of every cache")
    parser.add_argument("--threads", default="2",
                        help="`pipeline --threads` of every run (fixed, so the time ratios compare like with like)")
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the target and the caches")
    args = parser.parse_args()
    ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    tokenizer, template = FIXTURES / "tokenizers" / "qwen3.6", FIXTURES / "chat_templates" / "qwen3.6.jinja"
    if not tokenizer.is_dir() or not template.is_file():
        raise SystemExit(f"the Qwen3.6 tokenizer and template are not in {FIXTURES}: this benchmark needs them")
    if args.span <= max(ranks, default=0):
        parser.error(f"--span {args.span} must exceed the largest R ({max(ranks)}): the fit refuses an R the pilot does not span")
    begun = time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="projected-bytes-"))
    work.mkdir(parents=True, exist_ok=True)
    runner = Rehearsal(work, {"NO_COLOR": "1", "COLUMNS": "200"})
    machine = describe_machine()
    out: dict = {"machine": machine, "machine_line": machine_line(machine),
                 "target": "flagship" if args.hidden is None else f"random_target --hidden {args.hidden}", "layers": args.layers,
                 "num_shards": args.num_shards, "threads": args.threads, "runs": {}}
    target, caches = work / ("target" if args.hidden is None else f"target-h{args.hidden}"), []
    width = ["--flagship-layers", str(args.layers)] if args.hidden is None else ["--hidden", str(args.hidden)]

    def cli(*a: str) -> list[str]:
        return [sys.executable, "-m", "cli", "--threads", args.threads, *a]

    def stage(name: str, command: list[str], **kw) -> tuple[dict, dict]:
        """(the CLI's JSON result, the stage record) or a failure recorded, not raised."""
        load = os.getloadavg()[0]
        try:
            result = runner.run(name, command, **kw)
        except SystemExit as failed:
            record = runner.stages[-1]
            record["load_1min_before"] = round(load, 2)
            return {"failed": str(failed)[-3000:]}, record
        record = runner.stages[-1]
        record.update(load_1min_before=round(load, 2), load_1min_after=round(os.getloadavg()[0], 2))
        return result, record

    try:
        if not (target / "model.safetensors").is_file():
            _, record = stage("target", [sys.executable, "-m", "pipeline.toy.random_target", "--tokenizer", str(tokenizer),
                                         "--template", str(template), "--out", str(target), *width],
                                json_out=False)
            out["target_build"] = {"wall_s": record["wall_s"], "peak_rss_gb": record["peak_rss_gb"]}
            if record["exit"] != 0:
                raise SystemExit(json.dumps({"failed": record}, indent=2))
        (work / "extract.toml").write_text('[extract]\ncompute_dtype = "bfloat16"\n')
        data = work / "data.jsonl"
        out["data"] = write_rows(data, target, args.longest, args.span)
        pilot_tokens = out["data"]["tokens"]
        common = ["--config", str(work / "extract.toml"), "--target", str(target), "--data", str(data),
                  "--num-shards", str(args.num_shards), "--thinking", "--json"]
        runs = [("bf16", ["--hidden-format", "bf16"]), ("fp8", ["--hidden-format", "fp8"])]
        runs += [(f"fp8_R{r}", ["--hidden-format", "fp8", "--project-taps", str(r), "--pilot-tokens", str(pilot_tokens)])
                 for r in ranks]
        for name, flags in runs:
            cache = work / f"cache-{name}"
            shutil.rmtree(cache, ignore_errors=True)
            caches.append(cache)
            result, record = stage(f"extract {name}", cli("extract", *common, *flags, "--cache", str(cache)))
            run = {"command": record["command"], "wall_s": record["wall_s"], "peak_rss_gb": record["peak_rss_gb"],
                   "peak_anon_gb": record["peak_anon_gb"], "load_1min_before": record.get("load_1min_before"),
                   "load_1min_after": record.get("load_1min_after"), "exit": record["exit"]}
            out["runs"][name] = run
            if "failed" in result:
                run["failed"] = result["failed"]
                continue
            info, _ = stage(f"cache-info {name}", cli("cache-info", str(cache), "--json"))
            tokens = info["counts"]["tokens"]
            taps = tap_bytes(cache)
            projection = result.get("projection")
            run.update({
                "tokens": tokens, "extract_seconds": round(result["seconds"], 1),
                "stream_tokens_per_s": round(result["stream_tokens_per_s"], 1),
                "stored_bytes_per_token": info["bytes"]["per_token"],
                "extract_bytes_per_token": result["bytes_per_token"],
                "raw_bytes_per_token": info["bytes"]["raw_per_token"],
                "stored_vs_raw": info["bytes"]["stored_vs_raw"],
                "tap_bytes_per_token": taps / tokens,
                "other_bytes_per_token": info["bytes"]["per_token"] - taps / tokens,
                "projection": projection and {"rank": projection["rank"], "pilot_s": round(projection["seconds"], 1),
                                              "energy": projection["energy"], "pilot_tokens": projection["pilot_tokens"],
                                              "basis": projection["basis"]},
                "basis_file_bytes": (cache / "basis.safetensors").stat().st_size
                if (cache / "basis.safetensors").is_file() else None,
                "identity_projection": info["identity"]["capture"]["projection"]})
        done = {k: v for k, v in out["runs"].items() if "stored_bytes_per_token" in v}
        if "bf16" in done:
            for v in done.values():
                v["stored_vs_bf16_whole"] = v["stored_bytes_per_token"] / done["bf16"]["stored_bytes_per_token"]
        if "fp8" in done:
            fp8 = done["fp8"]
            for v in done.values():
                v["wall_vs_fp8_whole"] = v["wall_s"] / fp8["wall_s"]
                pilot = (v["projection"] or {}).get("pilot_s", 0.0)
                v["extraction_pass_vs_fp8_whole"] = (v["extract_seconds"] - pilot) / fp8["extract_seconds"]
    finally:
        if not args.keep:
            for path in (*caches, target):
                shutil.rmtree(path, ignore_errors=True)
            if args.work is None:
                shutil.rmtree(work, ignore_errors=True)
    out["work"] = str(work) if args.keep else None
    out["wall_s"] = round(time.perf_counter() - begun, 1)
    print(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
