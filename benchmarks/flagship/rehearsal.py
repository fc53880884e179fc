"""The flagship dress rehearsal (issue 40, DESIGN 12): every stage at Qwen3.6-27B's real widths,
each a real CLI subprocess as a user types it, on a CPU.

    python benchmarks/flagship/rehearsal.py [--layers 8] [--rows 3] [--work DIR] [--keep] [--drafter-layers 1]
                                   [--train-ranks 2]

What runs (random bf16 weights: the point is shapes, memory and plumbing, not predictions):
1. The target: Qwen3.6-27B's own text config cut to `--layers` (pipeline/toy/random_target.py
   `--flagship-layers`), the real Qwen3.6 tokenizer and chat template from the shared fixtures.
2. Data: `--rows` agent sessions of about 300 to 2,000 tokens (a system prompt with tools, then
   requests answered with reasoning, tool calls and tool replies; benchmarks/cache/conversations.py);
   `pipeline generate` (in-process) rewrites the first one's last turn first, as a user would (a
   random target rarely ends a turn: such rows are dropped and counted, which is what generate
   does with any unfinished turn, and the row is kept as written).
3. Stage one: `extract --dry-run`; `torchrun --nproc-per-node 8 pipeline extract --tp 8` (gloo)
   into a bucket of moto's S3 server on 127.0.0.1, bf16 and fp8; the same rows at tp 1 into a
   directory; the caches compared with each other and with a plain transformers forward;
   `cache-info` (bytes per token, requests); `verify-cache` on the bucket with `--recompute 1`.
4. Stage two: the reference drafter geometry at hidden 5120 (32 q / 8 kv heads of 128,
   intermediate 17,408, block 16, mask id 248070) with `--drafter-layers` layers (sliding 2048
   for all but the last, which is full) and 4 anchors a sequence, from the bf16 bucket: one rank
   uninterrupted; `--train-ranks` ranks killed (SIGKILL right after the step-2 checkpoint),
   resumed and killed again after the step-4 one, then finished on one rank; its log against the
   uninterrupted run's.
5. Export and use: the export against the keys serving engines read (and strictly loaded into the
   z-lab reference class where `dflash` is installed); `pipeline eval` on 2
   prompts, block and DDTree, `--batch-size 2`: lossless.

Needs about 30 GB of disk (the 11 GB target, two training runs' last checkpoints of 5.4 GB each,
twice that while one is written). Reduced to fit 2 cores and 24 GB in about half an hour, and why: 8 layers instead of 64 (the
11 GB target is loaded by every stage; 8 is the least depth whose default 5 taps are distinct,
DESIGN 3.1); compute in bf16 (this CPU multiplies bf16 5x faster than fp32); 3 sessions instead
of a few dozen (about 35 tokens a second at tp 1 and 15 at tp 8 on 2 cores); one drafter layer
and 4 anchors (fp32 weights, gradients and AdamW state of one layer at 5120 are about 8 GB a rank
with two ranks).

Prints one JSON document (the machine: CPU model and its bf16 support, pipeline/timing_machine.py; each
stage: command, wall seconds, the peak RSS and peak anonymous memory of its largest process, each
rank's for torchrun, result) and exits 1 at the first stage that fails. The per-stage table (the
machine's line above it: with avx512_bf16 the small rehearsal took 17 minutes, without 82) goes to
stderr at the end, and to `--table FILE` too, also when a stage failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO.parent / "shared" / "fixtures"
sys.path.insert(0, str(REPO))

from benchmarks.process_memory import ProcessMemory  # noqa: E402
from pipeline.timing_machine import describe_machine, machine_line  # noqa: E402
from pipeline.records.run_dir import RunDir  # noqa: E402
from pipeline.records.train_log import read_train_log  # noqa: E402
from pipeline.records.verify_result import VerifyResult  # noqa: E402

STEPS = 6


class Rehearsal:
    def __init__(self, work: Path, env: dict[str, str]):
        self.work, self.env, self.stages = work, env, []

    def run(self, name: str, args: list[str], *, killed: bool = False, extra_env: dict | None = None,
            json_out: bool = True) -> dict:
        """One stage as a user types it; its memory sampled per process (`ProcessMemory`);
        `killed`: the stage is meant to die (a planted SIGKILL), so any non-zero exit is expected."""
        start = time.perf_counter()
        child = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, **self.env, **(extra_env or {})})
        with ProcessMemory(child.pid) as memory:
            stdout, stderr = child.communicate()
        done = subprocess.CompletedProcess(args, child.returncode, stdout, stderr)
        wall = time.perf_counter() - start
        workers = memory.workers()
        record = {"stage": name, "command": " ".join(a for a in args if a != sys.executable), "wall_s": round(wall, 1),
                  "peak_rss_gb": max((w["peak_rss_gb"] for w in workers), default=None),
                  "peak_anon_gb": max((w["peak_anon_gb"] for w in workers), default=None),
                  "exit": done.returncode}
        if len(workers) > 1:
            record["ranks"] = workers
        self.stages.append(record)
        print(f"[rehearsal] {name}: exit {done.returncode}, {wall:.0f} s, peak RSS {record['peak_rss_gb']} GB "
              f"(anonymous {record['peak_anon_gb']} GB) in the largest of {len(workers)} process(es)", file=sys.stderr)
        if done.returncode != 0:
            record["stderr"] = done.stderr[-1500:]  # a planted kill leaves little; anything else says why
        if (done.returncode == 0) == killed:
            raise SystemExit(json.dumps({"failed": record, "stages": self.stages}, indent=2))
        if json_out and done.stdout.strip():
            try:
                record["result"] = json.loads(done.stdout)
            except json.JSONDecodeError:
                record["result"] = done.stdout[-2000:]
        return record.get("result") or {}


def stage_table(stages: list[dict], machine: dict) -> str:
    """The stages' wall times and peak memory as a markdown table under the machine's line."""
    lines = [f"Machine: {machine_line(machine)}", "", "| stage | wall s | peak RSS GB | peak anonymous GB | exit |",
             "|---|---|---|---|---|"]
    lines += [f"| {s['stage']} | {s['wall_s']} | {s['peak_rss_gb']} | {s['peak_anon_gb']} | {s['exit']} |" for s in stages]
    lines.append(f"| all stages | {round(sum(s['wall_s'] for s in stages), 1)} | | | |")
    return "\n".join(lines) + "\n"


def pipeline(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli", *args]


def torchrun(n: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
            "--master-port", str(29600 + os.getpid() % 300), "-m", "cli", *args]


def write_data(path: Path, rows: int, target: Path, longest: int) -> Path:
    """`rows` agent sessions (a system prompt with tools; requests answered with reasoning, tool
    calls and tool replies) from about 300 to about `longest` tokens with the target's real
    tokenizer and chat template, counted as extract renders them (thinking on)."""
    from benchmarks.cache.conversations import write_sessions
    from transformers import AutoTokenizer

    from pipeline.data.conversations import parse_row
    from pipeline.data.loss_mask import ConversationMasker

    masker = ConversationMasker(AutoTokenizer.from_pretrained(target), "<|im_end|>", {"enable_thinking": True})

    def tokens(obj: dict) -> int:
        row = parse_row(0, str(path), obj)
        return len(masker(row.messages, tools=row.tools, where=str(path)).input_ids)
    return write_sessions(path, rows, tokens, longest=longest)


def compare_caches(tp1: str, tp8: str, target: Path) -> dict:
    """Taps, argmax and top-k logits of the tp 8 cache against the tp 1 cache and both against a
    plain transformers forward of each sample (bf16, one sample at a time)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.cache.reader import CacheReader

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16, use_kernels=False).eval()
    readers = {"tp1": CacheReader(tp1), "tp8": CacheReader(tp8)}
    taps = readers["tp1"].manifest.identity.capture.target_layer_ids
    out = {key: {"tap_rel_err": [0.0] * len(taps), "argmax_agree": [], "argmax_shortfall": 0.0, "topk_abs_err": 0.0}
           for key in ("tp1_vs_forward", "tp8_vs_forward", "tp8_vs_tp1")}
    shards = {key: {int(s): r.find(int(s)) for name in r.shards for s in r.shard(name).sample_ids}
              for key, r in readers.items()}
    for sid in sorted(shards["tp1"]):
        stored = {key: shards[key][sid] for key in readers}
        ids = torch.from_numpy(stored["tp1"].read("input_ids", sid).astype(np.int64))[None]
        with torch.no_grad():
            forward = model(input_ids=ids, output_hidden_states=True)
        reference = {"hidden": torch.stack([forward.hidden_states[t + 1][0] for t in taps], 1).float(),
                     "logits": forward.logits[0].float()}
        for pair, (a, b) in {"tp1_vs_forward": ("tp1", None), "tp8_vs_forward": ("tp8", None),
                             "tp8_vs_tp1": ("tp8", "tp1")}.items():
            mine = stored[a].hidden(sid).float()
            other = reference["hidden"] if b is None else stored[b].hidden(sid).float()
            rel = ((mine - other).norm(dim=-1) / other.norm(dim=-1).clamp_min(1e-6)).amax(0)
            out[pair]["tap_rel_err"] = [max(x, float(y)) for x, y in zip(out[pair]["tap_rel_err"], rel)]
            argmax = stored[a].read("target_argmax", sid)
            other_argmax = reference["logits"].argmax(-1).numpy() if b is None else stored[b].read("target_argmax", sid)
            out[pair]["argmax_agree"].append(float((argmax == other_argmax).mean()))
            if b is None:
                logits = reference["logits"]
                at = torch.from_numpy(argmax.astype(np.int64))[:, None]
                out[pair]["argmax_shortfall"] = max(out[pair]["argmax_shortfall"],
                                                    float((logits.max(-1).values - logits.gather(1, at)[:, 0]).max()))
                top = logits.gather(1, torch.from_numpy(stored[a].read("target_topk_ids", sid).astype(np.int64)))
                err = np.abs(top.numpy() - stored[a].read("target_topk_logits", sid)).max()
            else:
                err = np.abs(stored[a].read("target_topk_logits", sid) - stored[b].read("target_topk_logits", sid)).max()
            out[pair]["topk_abs_err"] = max(out[pair]["topk_abs_err"], float(err))
    return out


def export_check(drafter: Path) -> dict:
    """The keys serving engines read (DESIGN 8), and a strict load into the z-lab reference class."""
    config = json.loads((drafter / "config.json").read_text())
    wanted = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rms_norm_eps", "vocab_size", "block_size", "num_target_layers", "layer_types",
              "sliding_window", "architectures", "torch_dtype")
    missing = [k for k in wanted if k not in config]
    dflash = config.get("dflash_config") or {}
    missing += [f"dflash_config.{k}" for k in ("target_layer_ids", "mask_token_id") if k not in dflash]
    result = {"missing_keys": missing, "architectures": config.get("architectures"),
              "mask_token_id": dflash.get("mask_token_id"), "target_layer_ids": dflash.get("target_layer_ids")}
    import importlib

    import torch
    try:
        cls = importlib.import_module("dflash.model").DFlashDraftModel
    except ImportError:
        result["reference_class"] = "skipped: z-lab's reference is not installed (pip install --no-deps dflash==0.1.0)"
        return result
    _, info = cls.from_pretrained(drafter, output_loading_info=True, dtype=torch.bfloat16, use_kernels=False)
    result["reference_class"] = {k: list(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="target depth (a multiple of 4; 8 keeps 5 distinct default taps)")
    parser.add_argument("--rows", type=int, default=3, help="agent sessions extracted (about 300 to 2,000 tokens each)")
    parser.add_argument("--longest", type=int, default=2000, help="tokens of the longest session (about)")
    parser.add_argument("--drafter-layers", type=int, default=1, help="drafter depth at hidden 5120 (memory: ~5.4 GB a layer a rank)")
    parser.add_argument("--train-ranks", type=int, default=2,
                        help="ranks of the killed training segments (2 at hidden 5120 with one drafter layer: about 8 GB "
                             "of anonymous memory a rank and the frozen 5 GB embedding and lm_head shared)")
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (the 11 GB target is reused by a rerun)")
    parser.add_argument("--table", type=Path, default=None,
                        help="also write the per-stage table (markdown, the machine's CPU and bf16 support above it) here")
    args = parser.parse_args()
    if args.table is not None and not args.table.parent.is_dir():
        parser.error(f"--table must be a file in an existing folder, got {args.table}")
    tokenizer, template = FIXTURES / "tokenizers" / "qwen3.6", FIXTURES / "chat_templates" / "qwen3.6.jinja"
    if not tokenizer.is_dir() or not template.is_file():
        raise SystemExit(f"the Qwen3.6 tokenizer and template are not in {FIXTURES}: the rehearsal needs them")
    work = args.work or Path(tempfile.mkdtemp(prefix="rehearsal-"))
    work.mkdir(parents=True, exist_ok=True)
    from harness.s3_server import ForgetfulRelay, MotoServer

    server = MotoServer()
    relay = ForgetfulRelay(server.port, drop=())  # forwards everything and counts the requests
    bucket = server.new_bucket()
    env = {**server.env(relay.endpoint), "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "COLUMNS": "200"}
    r = Rehearsal(work, env)
    machine = describe_machine()
    summary: dict = {"machine": machine, "work": str(work), "layers": args.layers, "rows": args.rows, "longest": args.longest,
                     "drafter_layers": args.drafter_layers, "train_ranks": args.train_ranks}
    try:
        target = work / "target"
        if not (target / "model.safetensors").is_file():
            r.run("target", [sys.executable, "-m", "pipeline.toy.random_target", "--tokenizer", str(tokenizer),
                             "--template", str(template), "--out", str(target), "--flagship-layers", str(args.layers)],
                  json_out=False)
        (work / "extract.toml").write_text('[extract]\ncompute_dtype = "bfloat16"\n')
        data = write_data(work / "convs.jsonl", args.rows, target, args.longest)
        rows = data.read_text().splitlines()
        (work / "first.jsonl").write_text(rows[0] + "\n")
        generated = r.run("generate", pipeline("generate", "--data", str(work / "first.jsonl"), "--out",
                                              str(work / "regen.jsonl"), "--target", str(target), "--max-new-tokens", "8",
                                              "--turns", "last", "--dtype", "bfloat16", "--json"))
        regenerated = (work / "regen.jsonl").read_text().splitlines() if (work / "regen.jsonl").is_file() else []
        (work / "data.jsonl").write_text("\n".join([*regenerated, *rows[1:]] if regenerated else rows) + "\n")
        summary["generate"] = {k: generated.get(k) for k in ("rows", "rows_written", "dropped_unfinished")}

        common = ["--config", str(work / "extract.toml"), "--target", str(target), "--data", str(work / "data.jsonl"),
                  "--num-shards", "2", "--thinking", "--json"]
        bill = r.run("extract --dry-run", pipeline("extract", *common, "--dry-run", "--cache", f"s3://{bucket}/bf16"))
        r.run("extract tp 1 bf16 (directory)", pipeline("extract", *common, "--cache", str(work / "tp1")))
        requests = {}
        for fmt in ("bf16", "fp8"):
            before = len(relay.requests)
            r.run(f"extract tp 8 {fmt} (bucket)", torchrun(8, "extract", *common, "--tp", "8", "--hidden-format", fmt,
                                                           "--cache", f"s3://{bucket}/{fmt}"))
            requests[fmt] = len(relay.requests) - before
        infos = {fmt: r.run(f"cache-info {fmt}", pipeline("cache-info", f"s3://{bucket}/{fmt}", "--json"))
                 for fmt in ("bf16", "fp8")}
        summary["stage_one"] = {
            "dry_run_raw_bytes_per_token": bill.get("raw_bytes_per_token"), "tokens": bill.get("tokens"),
            **{f"{fmt}_stored_bytes_per_token": infos[fmt]["bytes"]["per_token"] for fmt in infos},
            **{f"{fmt}_s3_requests_per_shard": requests[fmt] / 2 for fmt in requests},
            "kernel_path": list(infos["bf16"]["provenance"]["kernel_path"])}
        os.environ.update(env)
        summary["agreement"] = compare_caches(str(work / "tp1"), f"s3://{bucket}/bf16", target)
        for fmt in ("bf16", "fp8"):
            report = r.run(f"verify-cache {fmt} --recompute 1", pipeline("verify-cache", f"s3://{bucket}/{fmt}",
                                                                         "--recompute", "1", "--dtype", "bfloat16",
                                                                         "--json"))
            summary[f"verify_{fmt}"] = VerifyResult.from_json(report, where=f"verify-cache {fmt}").statuses()

        layers = args.drafter_layers
        (work / "train.toml").write_text("\n".join([
            "[train.drafter]", f"num_hidden_layers = {layers}", "num_attention_heads = 32", "num_key_value_heads = 8",
            "head_dim = 128", "intermediate_size = 17408", "rope_theta = 10000000.0", "max_position_embeddings = 262144",
            "layer_types = " + json.dumps(["sliding_attention"] * (layers - 1) + ["full_attention"]),
            "sliding_window = 2048", "block_size = 16", "mask_token = 248070",
            "[train.data]", "num_anchors = 4", "max_length = 512",
            "[train.schedule]", "batch_sequences = 2", "micro_batch_sequences = 1", "log_every = 1", "checkpoint_every = 2",
            # One checkpoint kept (a resume needs the last): each is 5.4 GB at this width (the fp32
            # drafter layer, fc and AdamW state), and the rehearsal keeps two runs.
            "keep_checkpoints = 1",
            "[train.job]", "dtype = \"bfloat16\"", ""]))
        train = ["train", "--config", str(work / "train.toml"), "--cache", f"s3://{bucket}/bf16", "--max-steps", str(STEPS),
                 "--json"]
        r.run("train 1 rank, uninterrupted", pipeline(*train, "--out", str(work / "run-one")))
        # SIGKILL right after a checkpoint is complete (renamed into place): the next segment resumes
        # from it. A segment that dies otherwise (the OOM killer, say) has no such checkpoint: it fails.
        kill = {"PIPELINE_FAILPOINT": "checkpoint.renamed@1"}
        moved = work / "run-moved"
        segments = []
        ranks = args.train_ranks
        launch = (lambda *a: torchrun(ranks, *a)) if ranks > 1 else pipeline
        for step in (2, 4):
            r.run(f"train {ranks} rank(s), killed after its step-{step} checkpoint", launch(*train, "--out", str(moved)),
                  killed=True, extra_env=kill, json_out=False)
            if not (moved / "checkpoints" / f"step-{step:08d}" / "trainer_state.json").is_file():
                raise SystemExit(json.dumps({"failed": f"the segment died before its step-{step} checkpoint, not at the "
                                                       "planted kill (out of memory? see dmesg)", "stages": r.stages}))
            segments.append(json.loads((moved / "run.json").read_text()))
        r.run("train resumed on 1 rank to the end", pipeline(*train, "--out", str(moved)))
        segments.append(json.loads((moved / "run.json").read_text()))
        one_log, moved_log = ([line.to_json() for line in read_train_log(RunDir(work / run).train_log)]
                              for run in ("run-one", "run-moved"))
        pairs = list(zip(one_log, moved_log, strict=True))
        summary["stage_two"] = {
            "segments": [{"world_size": x["world_size"], "resumed_from_step": x["resumed_from_step"]} for x in segments],
            "steps": [x["step"] for x in moved_log],
            "max_rel_loss_diff": max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in pairs),
            "max_rel_grad_norm_diff": max(abs(a["grad_norm"] - b["grad_norm"]) / abs(a["grad_norm"]) for a, b in pairs)}
        summary["export"] = export_check(work / "run-one" / "drafter")
        evaluation = r.run("eval", pipeline("eval", "--drafter", str(work / "run-one"), "--prompts", str(work / "data.jsonl"),
                                            "--limit", "2", "--max-new-tokens", "8", "--tree-budget", "16",
                                            "--batch-size", "2", "--dtype", "bfloat16", "--json"))
        summary["eval"] = {"lossless": evaluation.get("lossless"),
                           "block_identical": evaluation["block"]["identical_to_greedy"],
                           "block_departed_at_ties": evaluation["block"]["departed_at_ties"],
                           "tree_identical": evaluation["tree"]["16"]["identical_to_greedy"],
                           "tree_departed_at_ties": evaluation["tree"]["16"]["departed_at_ties"]}
    finally:
        table = stage_table(r.stages, machine)
        print(table, file=sys.stderr)
        if args.table is not None:
            args.table.write_text(table, encoding="utf-8")
        relay.stop()
        server.stop()
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"summary": summary, "stages": r.stages}, indent=2, default=str))


if __name__ == "__main__":
    main()
