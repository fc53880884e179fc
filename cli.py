"""`pipeline`: the command-line entry point. Thin by design: each command declares its options
and hands them to one function in `stages/`; user errors (PipelineError) are rendered here, once.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from pipeline.errors import PipelineError

# Nothing in this tool downloads at run time: targets, tokenizers and data are local paths.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

app = typer.Typer(
    name="pipeline",
    help="Train DFlash speculative-decoding drafters offline: extract a hidden-state cache once, "
         "verify it, train from it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_state = {"debug": False, "threads": "auto"}


@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")] = False,
          threads: Annotated[str, typer.Option(help="CPU threads for torch: N, or 'auto' (default): OMP_NUM_THREADS when set, else the cores other processes leave idle now (torch's default on an idle machine; on a busy one fewer threads run faster).")] = "auto") -> None:
    _state["debug"] = debug
    _state["threads"] = threads


def _user_errors(fn):
    """Render a PipelineError as one line on stderr and exit 1 (tracebacks only with --debug)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            from pipeline.threads import apply_threads
            apply_threads(_state["threads"])
            return fn(*args, **kwargs)
        except PipelineError as e:
            if _state["debug"]:
                raise
            from pipeline.ui import error
            error(str(e))
            raise typer.Exit(1) from None
        except OSError as e:
            # A full disk or a quota can strike any write (a log line, a lock file): one line
            # naming the file, not a traceback. Other OS errors keep theirs: they may be bugs.
            from pipeline.cache.files import STORAGE_ERRNOS, describe_os_error
            if _state["debug"] or e.errno not in STORAGE_ERRNOS:
                raise
            from pipeline.ui import error
            error(f"{e.filename or 'a write'}: {describe_os_error(e)}")
            raise typer.Exit(1) from None
    return wrapper


JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")]


@app.command()
@_user_errors
def extract(
    shards: Annotated[Optional[str], typer.Option(help="Shards this invocation writes, e.g. '0-63' or '3,5,8-11' (default: all).")] = None,
    config: Annotated[Optional[Path], typer.Option(help="TOML config (\\[extract] table); default ./extract.toml if present, else the embedded default.")] = None,
    target: Annotated[Optional[str], typer.Option(help="Target model directory (default: the embedded tiny target).")] = None,
    data: Annotated[Optional[list[str]], typer.Option(help="Conversations: JSONL/Parquet with `messages` or `conversations`, or pre-tokenized rows. Repeatable.")] = None,
    cache: Annotated[Optional[str], typer.Option(help="Cache to create or resume: a directory, file://PATH or s3://BUCKET/PREFIX (default ./dflash-cache).")] = None,
    num_shards: Annotated[Optional[int], typer.Option(help="Fixed shard count of the cache (default 64).")] = None,
    layers: Annotated[Optional[str], typer.Option(help="Comma-separated 0-based decoder-layer taps (default: the target preset's).")] = None,
    top_k: Annotated[Optional[int], typer.Option(help="Target top-k ids/logits stored per token (default 32).")] = None,
    hidden_format: Annotated[Optional[str], typer.Option(help="'bf16' (lossless bit pattern) or 'fp8' (e4m3 + per-token scale).")] = None,
    max_length: Annotated[Optional[int], typer.Option(help="Longest sample in tokens; longer ones follow --overlong.")] = None,
    overlong: Annotated[Optional[str], typer.Option(help="'truncate' (default), 'skip' or 'error' on over-long samples ('error' stops at the first one, when its shard is reached).")] = None,
    on_error: Annotated[Optional[str], typer.Option(help="'fail' (default) or 'skip' malformed rows (counted in the manifest).")] = None,
    thinking: Annotated[Optional[bool], typer.Option("--thinking/--no-thinking", help="Render with the template's thinking mode on or off (chat_template_kwargs.enable_thinking; default: the template's own default).")] = None,
    reasoning: Annotated[Optional[str], typer.Option(help="Reasoning in the data while thinking is off: 'error' (default: refuse the row), 'drop' it, or 'keep' and supervise it.")] = None,
    generated_by: Annotated[Optional[str], typer.Option(help="Who wrote the responses (e.g. the target's name), recorded in the manifest for rows that do not say.")] = None,
    batch_tokens: Annotated[Optional[int], typer.Option(help="Forward batch budget in tokens, padding included.")] = None,
    tp: Annotated[Optional[int], typer.Option(help="Tensor-parallel size under torchrun; world_size / tp data-parallel groups.")] = None,
    shard_locks: Annotated[Optional[bool], typer.Option("--shard-locks/--no-shard-locks", help="In a cache directory, skip shards another process is writing (flock; default on). Off where flock does not work: commits stay safe without it.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Run the target once and write the sharded, checksummed hidden-state cache."""
    from pipeline.config import ExtractConfig, load_config
    from stages.extract import run_extract

    if config is None and Path("extract.toml").is_file():
        config = Path("extract.toml")
    overrides = {"target": target, "data": data, "cache": cache, "num_shards": num_shards, "top_k": top_k,
                 "layers": _int_list(layers, "--layers"), "hidden_format": hidden_format, "max_length": max_length,
                 "overlong": overlong, "on_error": on_error, "batch_tokens": batch_tokens, "tp": tp,
                 "shard_locks": shard_locks}
    overrides.update({"reasoning": reasoning, "generated_by": generated_by})
    if thinking is not None:
        base = load_config(ExtractConfig, config, {}, section="extract").chat_template_kwargs
        overrides["chat_template_kwargs"] = {**base, "enable_thinking": thinking}
    cfg = load_config(ExtractConfig, config, overrides, section="extract")
    summary = run_extract(cfg, shards, progress=not json_out)
    if summary["rank"] == 0:
        _show_extract(summary, json_out)


def _int_list(text: Optional[str], option: str) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PipelineError(f"{option}: {text!r} is not a comma-separated list of integers") from None


def _show_extract(summary: dict, json_out: bool) -> None:
    from pipeline.ui import console, key_value_table, print_json

    if json_out:
        print_json(summary)
        return
    def fmt(v):
        return f"{v:,.2f}" if isinstance(v, float) else (f"{v:,}" if isinstance(v, int) else v)
    console.print(key_value_table("extract", [(k, fmt(v)) for k, v in summary.items() if k != "layout"]))


@app.command()
@_user_errors
def train(
    cache: Annotated[Optional[str], typer.Option(help="Cache written by `pipeline extract`: a directory, file://PATH or s3://BUCKET/PREFIX (default ./dflash-cache).")] = None,
    config: Annotated[Optional[Path], typer.Option(help="TOML config (\\[train] table); options below override it; default ./train.toml if present.")] = None,
    preset: Annotated[Optional[str], typer.Option(help="Recipe from manifests/presets ('tiny', 'qwen3.6-27b'); default: the one matching the cache's target.")] = None,
    target: Annotated[Optional[str], typer.Option(help="Target directory for the frozen embedding and lm_head (default: the one the cache records).")] = None,
    out: Annotated[Optional[str], typer.Option(help="Run directory: checkpoints/, train_log.jsonl, drafter/ (default ./dflash-run).")] = None,
    resume: Annotated[bool, typer.Option(help="Resume from the last complete checkpoint in --out.")] = True,
    max_steps: Annotated[Optional[int], typer.Option(help="Stop after this many optimizer steps (default: num_epochs of the cache).")] = None,
    num_epochs: Annotated[Optional[int], typer.Option(help="Epochs over the cache.")] = None,
    lr: Annotated[Optional[float], typer.Option(help="Peak learning rate (AdamW, warmup + cosine).")] = None,
    batch_sequences: Annotated[Optional[int], typer.Option(help="Sequences per optimizer step, all ranks together.")] = None,
    micro_batch_sequences: Annotated[Optional[int], typer.Option(help="Sequences per forward on one rank (gradient accumulation).")] = None,
    num_anchors: Annotated[Optional[int], typer.Option(help="Anchors per sequence, resampled every epoch.")] = None,
    block_size: Annotated[Optional[int], typer.Option(help="Draft block size B.")] = None,
    num_hidden_layers: Annotated[Optional[int], typer.Option(help="Drafter decoder layers.")] = None,
    loss: Annotated[Optional[str], typer.Option(help="'ce' (hard, target argmax) or 'kl' (soft, stored top-k).")] = None,
    noise_std: Annotated[Optional[float], typer.Option(help="Gaussian noise on the input context features (0: off).")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="'auto' (bf16 autocast where supported), 'float32' or 'bfloat16'.")] = None,
    attention: Annotated[Optional[str], typer.Option(help="Training attention: 'auto' (flex on CUDA, else split), 'flex' (BlockMask; CUDA) or 'split' (context + in-block parts).")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed for init, data order, anchors and noise.")] = None,
    log_every: Annotated[Optional[int], typer.Option(help="Steps between train_log.jsonl lines.")] = None,
    checkpoint_every: Annotated[Optional[int], typer.Option(help="Steps between training checkpoints.")] = None,
    allow_mixed_provenance: Annotated[Optional[bool], typer.Option("--allow-mixed-provenance", help="Train on shards computed by different linear-attention kernels (warns).")] = None,
    allow_incomplete_cache: Annotated[Optional[bool], typer.Option("--allow-incomplete-cache", help="Train on a cache whose shards are not all committed (warns; recorded in run.json).")] = None,
    cache_local: Annotated[Optional[str], typer.Option(help="For an s3:// cache: copy each file to this local directory on first read, so later epochs read the copies.")] = None,
    cache_local_size: Annotated[Optional[str], typer.Option(help="Most bytes kept under --cache-local, e.g. 500G (least recently used copies deleted; default 100G).")] = None,
    mask_token: Annotated[Optional[str], typer.Option(help="The drafter's mask token: an integer id or a token of the target's tokenizer, reserved and never in the data (default: the preset's; '<|MASK|>' for the embedded target, 248070 for Qwen3.6).")] = None,
    report_to: Annotated[Optional[str], typer.Option(help="Experiment trackers, comma-separated: tensorboard, wandb, mlflow, trackio (each an optional extra; default none). README: Watching a run.")] = None,
    verdict_every: Annotated[Optional[int], typer.Option(help="Log lines between live verdict checks (loss flat, plateau, spikes, known bug signatures; default 5).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Train a DFlash drafter from a cache alone (torchrun for data parallel)."""
    import os

    from pipeline.ui import TrainView, warning
    from stages.train import resolve_config, run_train

    if config is None and Path("train.toml").is_file():
        config = Path("train.toml")
    overrides = {"cache": cache, "preset": preset, "target": target, "out": out, "max_steps": max_steps,
                 "num_epochs": num_epochs, "lr": lr, "batch_sequences": batch_sequences,
                 "micro_batch_sequences": micro_batch_sequences, "num_anchors": num_anchors, "block_size": block_size,
                 "num_hidden_layers": num_hidden_layers, "loss": loss, "noise_std": noise_std, "dtype": dtype,
                 "attention": attention, "seed": seed, "log_every": log_every, "checkpoint_every": checkpoint_every,
                 "allow_mixed_provenance": allow_mixed_provenance, "allow_incomplete_cache": allow_incomplete_cache,
                 "cache_local": cache_local, "cache_local_size": cache_local_size, "report_to": report_to,
                 "verdict_every": verdict_every,
                 "mask_token": int(mask_token) if mask_token is not None and mask_token.strip().isdigit() else mask_token}
    cfg, preset_target = resolve_config(config, overrides)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    summary = run_train(cfg, preset_target=preset_target, resume=resume, view=TrainView(rank0 and not json_out),
                        warn=warning)
    if not rank0:
        return
    _show_train(summary, json_out)


def _show_train(summary: dict, json_out: bool) -> None:
    from pipeline.ui import console, key_value_table, print_json

    if json_out:
        print_json(summary)
        return
    last = summary.pop("last") or {}
    rows = [(k, v) for k, v in summary.items()]
    rows += [(k, f"{last[k]:.4f}") for k in ("loss", "accuracy", "top4_acc", "avg_streak", "ddtree_streak8") if k in last]
    console.print(key_value_table("train", rows))


@app.command()
@_user_errors
def generate(
    data: Annotated[list[str], typer.Option(help="Conversations to regenerate (JSONL/Parquet, `messages` or `conversations`, or embedded:train / embedded:heldout). Repeatable.")],
    out: Annotated[Path, typer.Option(help="Output JSONL (messages format, reasoning and tool calls as fields); work in progress lives in OUT.parts/ until every shard is done.")],
    target: Annotated[Optional[str], typer.Option(help="Target model directory (default: the embedded tiny target). With --server: its tokenizer checks the server's.")] = None,
    server: Annotated[Optional[str], typer.Option(help="An OpenAI-compatible server (e.g. http://127.0.0.1:8000) instead of the target in this process.")] = None,
    model: Annotated[Optional[str], typer.Option(help="The server's model name (default: the one it serves).")] = None,
    concurrency: Annotated[int, typer.Option(help="Requests in flight to the server at most.")] = 8,
    shards: Annotated[Optional[str], typer.Option(help="Shards this invocation writes, e.g. '0-7' (default: all).")] = None,
    num_shards: Annotated[Optional[int], typer.Option(help="Shard count (default: one per 256 rows); the unit of resumption.")] = None,
    turns: Annotated[str, typer.Option(help="'all' assistant turns in order (later ones see the regenerated earlier ones) or only the 'last'.")] = "all",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per turn at most; a turn that does not end by then drops its row (counted).")] = 512,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (with --temperature > 0).")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed; each turn draws from its own generator seeded by (seed, row, turn).")] = 0,
    batch_size: Annotated[int, typer.Option(help="Turns generated together (one target pass per token for all).")] = 16,
    device: Annotated[str, typer.Option(help="'auto' (the GPU when there is one), 'cpu', 'cuda' or 'cuda:N'.")] = "auto",
    dtype: Annotated[str, typer.Option(help="'auto' (bfloat16 on a GPU, float32 on the CPU), 'float32' or 'bfloat16'.")] = "auto",
    on_error: Annotated[str, typer.Option(help="'fail' (default: stop at the first row that cannot be parsed or rendered, naming its file:line and turn) or 'skip' such rows (each one warning line, counted).")] = "fail",
    json_out: JsonOpt = False,
) -> None:
    """Regenerate the conversations' assistant turns with the target itself (resumable, sharded)."""
    from pipeline.ui import ProgressBar, warning
    from stages.generate import run_generate

    rank = int(os.environ.get("RANK", 0))
    with ProgressBar("generate", "rows", total=0, enabled=not json_out and rank == 0) as bar:
        result = run_generate(data=data, out=out, target=target, server=server, model=model, concurrency=concurrency,
                              shards=shards, num_shards=num_shards, turns=turns,
                              max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                              batch_size=batch_size, device=device, dtype=dtype, on_error=on_error,
                              progress=bar.advance, on_total=bar.set_total, warn=warning)
    _show_generate(result, json_out)


def _show_generate(result: dict, json_out: bool) -> None:
    from pipeline.ui import console, key_value_table, print_json

    if json_out:
        print_json(result)
        return
    console.print(key_value_table("generate", [
        ("output", result["out"] if result["assembled"] else f"not yet: shards missing {result['shards_missing']}"),
        ("rows read / written", f"{result['rows']} / {result['rows_written']}"),
        ("rows skipped (--on-error skip)", result["rows_skipped"]),
        ("dropped (turn did not end)", result["dropped_unfinished"]),
        ("turns kept verbatim (unparsed)", result["kept_verbatim"]),
        ("shards written / already done", f"{result['shards_written']} / {result['shards_already_done']}"),
        ("rows/s, tokens/s", f"{result['rows_per_s']:.2f}, {result['tokens_per_s']:.1f}"),
        ("device", result["device"]),
    ]))


@app.command("eval")
@_user_errors
def eval_(
    drafter: Annotated[Path, typer.Option(help="Drafter export (RUN/drafter) or its run directory.")] = Path("dflash-run"),
    target: Annotated[Optional[Path], typer.Option(help="Target model directory (default: the one the run trained against, else the embedded target).")] = None,
    prompts: Annotated[Optional[Path], typer.Option(help="JSONL conversations; the prompt is everything before the last assistant turn (default: the embedded held-out set).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt at most.")] = 96,
    block_size: Annotated[Optional[int], typer.Option(help="Draft block size (default: the drafter's).")] = None,
    tree_budget: Annotated[str, typer.Option(help="DDTree node budgets, comma-separated ('' for none).")] = "16,64",
    tree_top_k: Annotated[int, typer.Option(help="Candidates per draft position for DDTree.")] = 8,
    report_to: Annotated[Optional[str], typer.Option(help="Also send the figures (taus, tau_walk with --cache) to the training run's trackers, as eval/... at its last step: tensorboard, wandb, mlflow, trackio.")] = None,
    tree_verify: Annotated[str, typer.Option(help="How a DDTree is verified: 'auto' (by the target's size; recorded in the result), 'tree' (each node once: ancestor mask, per-node recurrent states; faster where the target's compute dominates) or 'paths' (root-to-leaf paths as batch rows; faster on tiny targets, and for attention implementations that take no mask).")] = "auto",
    batch_size: Annotated[int, typer.Option(help="Prompts decoded together, one target pass per step for all of them (each still checked against its own greedy run); worth it on a GPU.")] = 1,
    limit: Annotated[Optional[int], typer.Option(help="Only the first N prompts.")] = None,
    cache: Annotated[Optional[str], typer.Option(help="A cache (directory or s3://BUCKET/PREFIX) of the same conversations: also report the teacher-forced avg_streak + 1 on their last assistant turns.")] = None,
    device: Annotated[str, typer.Option(help="'auto' (the GPU when there is one), 'cpu', 'cuda' or 'cuda:N'.")] = "auto",
    dtype: Annotated[str, typer.Option(help="Target and drafter dtype: 'auto' (bfloat16 on a GPU, float32 on the CPU), 'float32' or 'bfloat16'.")] = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Real speculative decoding with the live target (greedy): acceptance length tau for DFlash
    blocks and DDTree trees, checked token for token against plain greedy decoding."""
    from pipeline.ui import ProgressBar, warning
    from stages.eval import run_eval

    budgets = _int_list(tree_budget, "--tree-budget") or []
    count = limit or sum(1 for line in open(prompts, encoding="utf-8") if line.strip()) if prompts and Path(prompts).is_file() else (limit or 200)
    with ProgressBar("eval", "prompts", total=count, enabled=not json_out) as bar:
        result = run_eval(drafter, target=target, prompts=prompts, max_new_tokens=max_new_tokens, block_size=block_size,
                          tree_budgets=budgets, tree_top_k=tree_top_k, limit=limit, cache=cache, progress=bar.advance,
                          device=device, dtype=dtype, tree_verify=tree_verify, batch_size=batch_size, warn=warning,
                          report_to=report_to)
    _show_eval(result, json_out)
    if not result["lossless"]:
        raise typer.Exit(1)


def _show_eval(result: dict, json_out: bool) -> None:
    from rich.table import Table

    from pipeline.ui import console, error, print_json

    if json_out:
        print_json(result)
    else:
        g = result["greedy"]
        table = Table(title=f"eval: {result['prompts']} prompts, block {result['block_size']}, "
                            f"greedy {g['tokens_per_s']:,.0f} tok/s", title_justify="left")
        for col in ("method", "tau (mean of means)", "tau (pooled)", "verify passes/token", "target passes/token",
                    "tok/s", "speed vs greedy", "identical to greedy"):
            table.add_column(col)
        rows = [("block", result["block"])] + [(f"ddtree {b}", r) for b, r in result["tree"].items()]
        for name, r in rows:
            table.add_row(name, f"{r['tau_mean_of_means']:.2f}", f"{r['tau_pooled']:.2f}", f"{r['verify_passes_per_token']:.3f}",
                          f"{r['target_passes_per_token']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{r['speedup_vs_greedy']:.2f}x",
                          f"{r['identical_to_greedy']}/{result['prompts']}")
        console.print(table)
        if result["tree"]:
            console.print(f"DDTree verified as {result['tree_verify']} ({result['tree_verify_reason']})", highlight=False)
        hist = result["block"]["accept_histogram"]
        console.print("block acceptance lengths: " + "  ".join(f"{k}:{v}" for k, v in hist.items()), highlight=False)
        if "teacher_forced" in result:
            tf = result["teacher_forced"]
            console.print(f"teacher-forced on the cache (last assistant turns, {tf['anchors']:,} anchors): "
                          f"avg_streak + 1 = {tf['tau_estimate']:.2f}, decoding replayed on its streaks = "
                          f"{tf['tau_walk']:.2f}, accuracy {tf['accuracy']:.3f}", highlight=False)
    if not result["lossless"]:
        error("speculative output differs from greedy decoding (a bug: speculative decoding is lossless)")


@app.command()
@_user_errors
def report(
    logs: Annotated[list[Path], typer.Argument(help="train_log.jsonl files or run directories; several are compared.")],
    window: Annotated[Optional[int], typer.Option(help="Entries per rolling window (default: 200, at most an eighth of the shortest log).")] = None,
    every: Annotated[Optional[int], typer.Option(help="Steps between checkpoints (default: about 8 per run).")] = None,
    epochs: Annotated[Optional[float], typer.Option(help="Epochs of the full run, for extrapolation (default: the run's plan, else the last step).")] = None,
    steps_per_epoch: Annotated[Optional[float], typer.Option(help="Steps per epoch, if the log does not record it.")] = None,
    reference_tau: Annotated[Optional[float], typer.Option(help="Acceptance length of a reference drafter to hold the extrapolated tau against.")] = None,
    out: Annotated[Path, typer.Option(help="Folder for the PNG plots.")] = Path("dflash-report"),
    follow: Annotated[bool, typer.Option("--follow", help="Re-draw the report (and the plots) as the logs grow, until every run reaches its last step; with --json, one JSON document per line per re-draw.")] = False,
    interval: Annotated[float, typer.Option(help="With --follow: seconds between looks at the logs.")] = 10.0,
    json_out: JsonOpt = False,
) -> None:
    """Convergence diagnostics: rolling means with confidence intervals, plateau/regression
    verdicts, cliffs, grad-norm anomalies, extrapolation, run-vs-run comparison, plots."""
    import json as json_module

    from stages.report import follow_report, run_report

    options = {"window_size": window, "every": every, "epochs": epochs, "steps_per_epoch": steps_per_epoch,
               "reference_tau": reference_tau, "plots": out}
    if follow:
        if interval <= 0:
            raise PipelineError(f"--interval must be > 0, got {interval}")

        def show(result):
            if json_out:
                print(json_module.dumps(result, default=str), flush=True)
            else:
                _show_report(result)

        follow_report(logs, interval=interval, show=show, **options)
        return
    result = run_report(logs, **options)
    if json_out:
        from pipeline.ui import print_json
        print_json(result)
    else:
        _show_report(result)


def _fmt_window(w) -> str:
    if not isinstance(w, dict):
        return "missing"
    ci = w.get("ci95")
    return f"{w['mean']:.4g} ± {ci:.2g}" if ci is not None else f"{w['mean']:.4g}"


def _show_report(result: dict) -> None:
    from rich.table import Table

    from pipeline.ui import console

    colours = {"improving": "green", "plateau": "yellow", "regressing": "bold red", "missing": "red"}
    for run in result["runs"]:
        table = Table(title=f"{run['name']}: {run['entries']} entries to step {run['last_step']:g}, window "
                            f"{run['window']} entries", title_justify="left")
        for col in ("metric", "last window (95% CI)", "change vs previous window", "z", "verdict", "extrapolated at end"):
            table.add_column(col)
        for metric, v in run["verdicts"].items():
            last = next((c[metric] for c in reversed(run["checkpoints"]) if isinstance(c.get(metric), dict)), None)
            verdict = v.get("verdict", "")
            ext = run["extrapolated"].get(metric)
            table.add_row(metric, _fmt_window(last), f"{v['change']:+.3g}" if "change" in v else "",
                          f"{v['z']:+.1f}" if "z" in v else "", f"[{colours.get(verdict, 'white')}]{verdict}[/]",
                          f"{ext:.4g}" if isinstance(ext, float) else "")
        console.print(table)
        checkpoints = Table(title=f"{run['name']}: rolling means at checkpoints", title_justify="left")
        for col in ("at", "loss", "accuracy", "avg_streak", "ddtree_streak8"):
            checkpoints.add_column(col)
        for c in run["checkpoints"]:
            checkpoints.add_row(c["at"], *(_fmt_window(c[m]) for m in ("loss", "accuracy", "avg_streak", "ddtree_streak8")))
        console.print(checkpoints)
        for problem in run["cliffs"]:
            console.print(f"[bold red]cliff[/] {problem['metric']} at step {problem['step']:g}: "
                          f"{problem['before']:.4g} -> {problem['after']:.4g}")
        for problem in run["grad_norm_anomalies"]:
            console.print(f"[bold red]grad-norm anomaly[/] at step {problem['step']:g}: {problem['value']:.4g}")
        if run["missing"]:
            console.print("[red]missing keys[/] (entries without them; never counted as zero): "
                          + ", ".join(f"{k} in {n}" for k, n in run["missing"].items()))
        if "reference" in run and run["reference"]["extrapolated_tau"] is not None:
            ref = run["reference"]
            console.print(f"extrapolated tau {ref['extrapolated_tau']:.2f} vs reference {ref['reference_tau']:.2f} "
                          f"({ref['gap']:+.2f}); {ref['note']}")
    if "comparison" in result:
        names = [r["name"] for r in result["runs"]]
        table = Table(title="runs at matching steps (rolling means)", title_justify="left")
        for col in ("step", "metric", *names, "leader", "margin", "beyond noise"):
            table.add_column(col)
        for row in result["comparison"]:
            for metric in ("loss", "accuracy", "avg_streak"):
                e = row[metric]
                means = [f"{e['means'][n]:.4g}" if isinstance(e["means"][n], float) else "missing" for n in names]
                table.add_row(f"{row['step']:g}", metric, *means, e.get("leader", ""),
                              f"{e['margin']:.3g}" if "margin" in e else "", "yes" if e.get("significant") else "no")
        console.print(table)
    for path in result.get("plots", []):
        console.print(f"plot: {path}", highlight=False)


@app.command("verify-cache")
def verify_cache(
    cache: Annotated[str, typer.Argument(help="Cache to verify: a directory, file://PATH or s3://BUCKET/PREFIX.")],
    shards: Annotated[Optional[str], typer.Option(help="Only these shards, e.g. '0-7'.")] = None,
    target: Annotated[Optional[Path], typer.Option(help="Target directory (default: the one the manifest records, if present).")] = None,
    recompute: Annotated[int, typer.Option(help="Samples to re-run through --target from the embeddings and compare tap by tap: one of every shard, the longest and the truncated ones first, then random ones.")] = 0,
    tail_rate: Annotated[float, typer.Option(help="Fraction of samples whose stored deepest tap is run through the layers after it, the final norm and the lm_head and compared with the stored predictions (default: every sample; 0: off).")] = 1.0,
    device: Annotated[str, typer.Option(help="Where the model checks run: auto (a GPU when present), cpu or cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(help="Model dtype for the checks: auto (bfloat16 on a GPU, float32 on CPU), float32 or bfloat16.")] = "auto",
    sample_rate: Annotated[float, typer.Option(help="Fraction of chunks whose checksums are verified.")] = 1.0,
    show: Annotated[Optional[int], typer.Option(help="Print this sample decoded, supervised reasoning, content, tool-call and end-of-turn tokens coloured apart on a terminal, tagged [[R ...]] [[C ...]] [[T ...]] [[E ...]] when piped; with --json its tokens, labels, loss mask and kinds are in the document.")] = None,
    seed: Annotated[int, typer.Option(help="Seed for the sampled chunks and samples.")] = 0,
    json_out: JsonOpt = False,
) -> None:
    """Prove a cache is complete, intact, aligned and correctly masked. Exit 0: all checks pass;
    1: a check failed; 2: usage error."""
    from pipeline.threads import apply_threads
    from pipeline.ui import error, print_json, print_sample
    from stages.verify import run_verify, show_sample

    try:
        apply_threads(_state["threads"])
        shown = show_sample(cache, show, target) if show is not None else None
        if shown is not None and not json_out:
            print_sample(shown)
        result = run_verify(cache, shards=shards, target=target, recompute=recompute, tail_rate=tail_rate,
                            sample_rate=sample_rate, seed=seed, device=device, dtype=dtype,
                            progress=not json_out)
        if shown is not None:
            result["sample"] = shown
    except PipelineError as e:
        if _state["debug"]:
            raise
        error(str(e))
        raise typer.Exit(2) from None
    if json_out:
        print_json(result)
    else:
        _show_checks(result)
    raise typer.Exit(0 if result["passed"] else 1)


def _show_checks(result: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    from pipeline.ui import console

    table = Table(title=f"verify-cache {escape(result['cache'])}", title_justify="left")
    table.add_column("check", style="bold")
    table.add_column("status")
    table.add_column("evidence")
    colours = {"pass": "green", "fail": "bold red", "skipped": "yellow", "inconclusive": "yellow"}
    for check in result["checks"]:
        table.add_row(check["check"], f"[{colours[check['status']]}]{check['status']}[/]", escape(check["summary"]))
        for problem in (check["evidence"].get("problems") or check["evidence"].get("failures")
                        or check["evidence"].get("mismatched") or [])[:5]:
            table.add_row("", "", f"[red]{escape(problem)}[/]")
    console.print(table)
    unsure = [c["check"] for c in result["checks"] if c["status"] == "inconclusive"]
    note = f" [yellow](inconclusive: {', '.join(unsure)})[/]" if unsure else ""
    console.print(("[bold green]all checks passed[/]" if result["passed"] else "[bold red]verification FAILED[/]") + note)


@app.command()
@_user_errors
def demo(
    out: Annotated[Path, typer.Option(help="Folder for everything the demo writes.")] = Path("dflash-demo"),
    quick: Annotated[bool, typer.Option(help="A one-minute version (fewer conversations, steps and prompts).")] = False,
    report_to: Annotated[Optional[str], typer.Option(help="Experiment trackers for the training step (as `train --report-to`).")] = None,
    block_size: Annotated[Optional[int], typer.Option(help="The drafter's block size (default: the tiny preset's 8; 16 is the flagship's and takes longer, BENCHMARKS.md).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """The whole pipeline on the embedded tiny target: extract, verify, train, speculative-decoding
    eval, report. About 5 minutes on 2 CPU cores; re-running resumes."""
    from pipeline.ui import err_console
    from stages.demo import run_demo

    summary = run_demo(out, quick=quick, progress=not json_out, report_to=report_to, block_size=block_size,
                       say=lambda m: err_console.print(f"[bold]{m}[/]", highlight=False, markup=True))
    if json_out:
        from pipeline.ui import print_json
        print_json(summary)
        return
    _show_demo(summary)


def _show_demo(s: dict) -> None:
    from pipeline.ui import console, key_value_table

    t, e, c = s["train"], s["eval"], s["cache"]
    rows = [
        ("cache", f"{c['path']}: {c['tokens']:,} tokens in {c['shards']} shards, {c['bytes']:,} bytes, "
                  f"{c['bytes_per_token']:,.0f} bytes/token"),
        ("verify-cache", "all checks passed" if s["verify"]["passed"] else f"FAILED: {', '.join(s['verify']['failed_checks'])}"),
        ("training", f"{t['steps']} steps, block {t['block_size']}: loss {t['loss']:.3f}, accuracy {t['accuracy']:.3f}, "
                     f"avg_streak {t['avg_streak']:.2f} (teacher-forced)"),
        ("eval", f"{e['prompts']} held-out prompts, outputs identical to greedy: {'yes' if e['lossless'] else 'NO'}"),
        ("tau (block)", f"{e['block_tau_mean_of_means']:.2f} mean of per-response means, {e['block_tau_pooled']:.2f} pooled"),
        *[(f"tau (DDTree {k[6:].split('_')[0]})", f"{v:.2f} pooled") for k, v in e.items() if k.startswith("ddtree")],
        ("drafter", t["drafter"]),
        ("report", ", ".join(s["report"]["plots"])),
        ("wall time", f"{s['timings']['total_s']:.0f} s (" + ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in s["timings"].items()
                                                              if k != "total_s") + ")"),
    ]
    console.print(key_value_table("demo", rows))


@app.command("target-info")
@_user_errors
def target_info(
    path: Annotated[Optional[Path], typer.Argument(help="Target model directory (default: the embedded tiny target).")] = None,
    data: Annotated[Optional[Path], typer.Option(help="JSONL conversations the target generated, for a self-agreement check.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Summarise a target model directory: class, layers, taps, tokenizer, chat template."""
    from pipeline.embedded import BUILD_REPORT, HELDOUT_DATA, TARGET_DIR
    from stages.summary import target_summary

    build = None
    if path is None:
        path, data, build = TARGET_DIR, data or HELDOUT_DATA, BUILD_REPORT
    _show_summary(target_summary(path, heldout=data, build_report=build), json_out)


def _show_summary(summary: dict, json_out: bool) -> None:
    from pipeline.ui import console, key_value_table, print_json

    if json_out:
        print_json(summary)
        return
    def fmt(value):
        return f"{value:.4g}" if isinstance(value, float) else value

    console.print(key_value_table("target", [(k, fmt(v)) for k, v in summary.items() if not isinstance(v, dict)]))
    for section, values in summary.items():
        if isinstance(values, dict):
            console.print(key_value_table(section, [(k, fmt(v)) for k, v in values.items()]))


if __name__ == "__main__":
    app()
