"""The real Qwen3.6 tokenizer at the real vocabulary: peak memory and wall time of each command.

    python benchmarks/flagship/real_vocab.py --fixtures ../shared/fixtures --work DIR [--repo DIR] [--stages] [--memory]
        [--lengths 256,1024,4096] [--batches 1,8] [--limit-gb 21] [--target DIR --drafter RUN --dtype bfloat16] [--json]

Builds (once, into --work) a random-weight `Qwen3_5ForCausalLM` of Qwen3.6-27B's vocabulary
(248,320) with the embedded target's layer layout at hidden 64, the real Qwen3.5/3.6 tokenizer
and the real Qwen3.6 chat template (pipeline/toy/random_target.py), then runs the CLI of the
repository at --repo (default: this one; point it at a checkout of an older commit to measure
"before") as subprocesses, each timed, its peak RSS read from the kernel (wait4):

- `--stages`: extract (32 agent rows with reasoning and tool calls, benchmarks/cache/conversations.py;
  also profiled in a second run: the top functions by own time), verify-cache, train (mask id 248070, 20 steps),
  eval (`--limit 4 --max-new-tokens 16`) on the rows without tools and on the agent rows,
  generate (8 rows, 16 new tokens).
- `--memory`: `pipeline eval` and `pipeline generate` on prompts of each length in --lengths
  (a user turn of filler words sized to the exact prompt token count), at each batch size in
  --batches; 4 new tokens. Each run is capped at --limit-gb of address space, so a run that would
  exhaust the machine fails instead (reported as such). Then the bytes per prompt token: the
  slope of peak RSS over prompt tokens x batch.

The drafter for eval is trained here by the repo under test (20 steps on the extracted cache).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE))

from benchmarks.cli_args import positive_ints  # noqa: E402

MASK_ID = 248070   # Qwen3.6's reserved token the reference drafters use (DESIGN 2)


def run(repo: Path, args: list[str], *, limit_gb: float | None = None, profile: Path | None = None) -> dict:
    """One CLI call of `repo` as a child process: wall seconds, peak RSS (GB, the kernel's figure
    for that child via wait4), peak anonymous memory (sampled: what a prompt's tokens grow; a
    target's weights mapped from its file are resident pages too, and the kernel may drop them
    while the process runs, so RSS alone hides a slope of kilobytes a token under gigabytes of
    them), exit code, last stderr line."""
    import tempfile

    from benchmarks.process_memory import ProcessMemory

    env = {**os.environ, "PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    cmd = [sys.executable, *(["-m", "cProfile", "-o", str(profile)] if profile else []), "-m", "cli", *args]

    def cap():
        if limit_gb:
            size = int(limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (size, size))

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        child = subprocess.Popen(cmd, cwd=repo, env=env, stdout=out, stderr=err, preexec_fn=cap)
        with ProcessMemory(child.pid) as memory:
            _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    tail = [line for line in stderr.splitlines() if line.strip()][-1:]
    return {"args": " ".join(args), "rc": child.returncode, "wall_s": round(seconds, 2),
            "peak_rss_gb": round(usage.ru_maxrss / 2**20, 3),
            "peak_anon_gb": max((w["peak_anon_gb"] for w in memory.workers()), default=None), "stderr_tail": tail[0][:300] if tail else "",
            "stdout": stdout}


def build(work: Path, fixtures: Path) -> Path:
    from pipeline.toy.random_target import build_random_target

    target = work / "target"
    if not (target / "model.safetensors").is_file():
        build_random_target(target, fixtures / "tokenizers" / "qwen3.6", fixtures / "chat_templates" / "qwen3.6.jinja")
    return target


def prompt_rows(path: Path, tokenizer, length: int, count: int) -> Path:
    """`count` conversations whose prompt (everything before the assistant turn, generation prompt
    included) is exactly `length` tokens: a user turn of filler words, one token each."""
    words = ["river", "cloud", "stone", "amber", "maple", "ocean", "tiger", "piano"]

    def prompt_len(n: int, k: int) -> int:
        text = " ".join(words[(i + k) % len(words)] for i in range(n))
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])

    rows = []
    for k in range(count):
        n = length - (prompt_len(1, k) - 1)
        while prompt_len(n, k) > length:
            n -= 1
        text = " ".join(words[(i + k) % len(words)] for i in range(n))
        assert prompt_len(n, k) == length, (length, prompt_len(n, k))
        rows.append({"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def stages(repo: Path, work: Path, target: Path) -> dict:
    from benchmarks.cache.conversations import write_dataset

    data = write_dataset(work / "agent.jsonl", 32)
    for d in ("cache", "run", "gen.jsonl", "gen.jsonl.parts"):
        subprocess.run(["rm", "-rf", str(work / d)], check=True)
    (work / "train.toml").write_text(f"[train.drafter]\nmask_token = {MASK_ID}\n")
    extract = ["extract", "--target", str(target), "--data", str(data), "--num-shards", "2", "--max-length", "100000"]
    results = {"extract": run(repo, [*extract, "--cache", str(work / "cache")])}
    # The profile is a second run (cProfile slows Python-heavy code): where the time goes, not how much.
    profile = work / "extract.prof"
    run(repo, [*extract, "--cache", str(work / "cache-profiled")], profile=profile)
    subprocess.run(["rm", "-rf", str(work / "cache-profiled")], check=True)
    stats = pstats.Stats(str(profile))
    top = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:8]   # by own (total) time
    results["extract"]["profile_top"] = [{"function": f"{Path(f).name}:{line}({name})", "own_s": round(tt, 2),
                                          "cumulative_s": round(ct, 2), "calls": nc}
                                         for (f, line, name), (cc, nc, tt, ct, _) in top]
    results["verify"] = run(repo, ["verify-cache", str(work / "cache"), "--target", str(target)])
    results["train"] = run(repo, ["train", "--cache", str(work / "cache"), "--out", str(work / "run"),
                                            "--config", str(work / "train.toml"), "--max-steps", "20"])
    # Rows without tools (before issue 28 eval's own reader could not render tool-call rows), then the agent rows.
    plain = work / "plain.jsonl"
    plain.write_text("".join(line for line in data.read_text().splitlines(keepends=True) if '"tools"' not in line))
    results["eval"] = run(repo, ["eval", "--drafter", str(work / "run"), "--target", str(target), "--prompts",
                                 str(plain), "--limit", "4", "--max-new-tokens", "16", "--json"])
    results["eval_agent_rows"] = run(repo, ["eval", "--drafter", str(work / "run"), "--target", str(target), "--prompts",
                                            str(data), "--limit", "4", "--max-new-tokens", "16", "--json"])
    results["generate"] = run(repo, ["generate", "--data", str(data), "--out", str(work / "gen.jsonl"),
                                               "--target", str(target), "--max-new-tokens", "16", "--shards", "0",
                                               "--num-shards", "4", "--json"])
    for r in results.values():
        r.pop("stdout", None)
    return results


def memory(repo: Path, work: Path, target: Path, lengths: list[int], batches: list[int], limit_gb: float, *,
           drafter: Path | None = None, dtype: str | None = None) -> dict:
    """Peak RSS of eval and generate per prompt length and batch; `drafter`: a trained run to
    evaluate (default: WORK/run, trained by --stages); `dtype`: passed to both commands."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    runs = []
    for length in lengths:
        prompts = prompt_rows(work / f"prompts-{length}.jsonl", tokenizer, length, max(batches))
        for batch in batches:
            for command in ("eval", "generate"):
                if command == "eval":
                    args = ["eval", "--drafter", str(drafter or work / "run"), "--target", str(target), "--prompts", str(prompts),
                            "--limit", str(batch), "--batch-size", str(batch), "--max-new-tokens", "4", "--tree-budget", ""]
                else:
                    out = work / f"mem-{length}-{batch}.jsonl"
                    subprocess.run(["rm", "-rf", str(out), f"{out}.parts"], check=True)
                    limited = work / f"prompts-{length}-{batch}.jsonl"
                    limited.write_text("".join(prompts.read_text().splitlines(keepends=True)[:batch]))
                    args = ["generate", "--data", str(limited), "--out", str(out), "--target", str(target),
                            "--batch-size", str(batch), "--max-new-tokens", "4"]
                r = run(repo, [*args, *(["--dtype", dtype] if dtype else [])], limit_gb=limit_gb)
                r.pop("stdout", None)
                runs.append({"command": command, "prompt_tokens": length, "batch": batch, **r})
                print(json.dumps(runs[-1]), file=sys.stderr)
    fits = {}
    for command in ("eval", "generate"):
        for batch in batches:
            for measure in ("peak_rss_gb", "peak_anon_gb"):
                points = [(r["prompt_tokens"] * batch, r[measure] * 2**30) for r in runs
                          if r["command"] == command and r["batch"] == batch and r["rc"] == 0 and r[measure] is not None]
                if len(points) >= 2:
                    n = len(points)
                    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
                    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
                    name = f"{command}_batch{batch}" + ("_anonymous" if measure == "peak_anon_gb" else "")
                    fits[name] = {"bytes_per_prompt_token": round(slope), "points": len(points),
                                  "intercept_gb": round((my - slope * mx) / 2**30, 3)}
    return {"runs": runs, "fits": fits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=HERE.parent / "shared" / "fixtures",
                        help="the shared fixtures folder (tokenizers/qwen3.6, chat_templates/qwen3.6.jinja)")
    parser.add_argument("--work", type=Path, required=True, help="folder for the target, data, cache, run and outputs")
    parser.add_argument("--repo", type=Path, default=HERE, help="the checkout whose CLI is measured (default: this one)")
    parser.add_argument("--stages", action="store_true", help="time extract / verify-cache / train / eval / generate")
    parser.add_argument("--memory", action="store_true", help="peak RSS of eval and generate by prompt length and batch")
    parser.add_argument("--lengths", default="256,1024,4096", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    parser.add_argument("--limit-gb", type=float, default=21.0, help="address-space cap per memory run (GB)")
    parser.add_argument("--target", type=Path, default=None,
                        help="measure this target instead of building the hidden-64 one (e.g. the rehearsal's "
                             "flagship-width target: benchmarks/flagship/rehearsal.py --keep)")
    parser.add_argument("--drafter", type=Path, default=None, help="--memory: evaluate this training run's drafter "
                        "(default: WORK/run, trained by --stages)")
    parser.add_argument("--dtype", default=None, help="--memory: the compute dtype of eval and generate (e.g. bfloat16)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    if not (args.fixtures / "tokenizers" / "qwen3.6").is_dir():
        parser.error(f"{args.fixtures}: no tokenizers/qwen3.6 folder (pass --fixtures)")
    lengths = positive_ints(parser, "--lengths", args.lengths)
    batches = positive_ints(parser, "--batches", args.batches)
    args.work.mkdir(parents=True, exist_ok=True)
    target = args.target or build(args.work, args.fixtures)
    result = {"repo": str(args.repo), "target": str(target)}
    if args.stages:
        result["stages"] = stages(args.repo.resolve(), args.work.resolve(), target.resolve())
    if args.memory:
        result["memory"] = memory(args.repo.resolve(), args.work.resolve(), target.resolve(), lengths, batches, args.limit_gb,
                                  drafter=args.drafter and args.drafter.resolve(), dtype=args.dtype)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
