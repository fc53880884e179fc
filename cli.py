"""`pipeline`: the command-line entry point. Thin by design: each command declares its options
and hands them to one function in `stages/`; user errors (PipelineError) are rendered here, once.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from pipeline.files import STORAGE_ERRNOS, describe_os_error
from pipeline.config import ExtractConfig, TrainConfig, int_list, load_config
from pipeline.embedded import BUILD_REPORT, HELDOUT_DATA, TARGET_DIR
from pipeline.errors import PipelineError
from pipeline.threads import apply_threads
from pipeline.tracking import TRACKERS
from pipeline.ui import ProgressBar, TrainView, error, print_sample, warning
from pipeline.ui.config_options import config_options
from pipeline.ui.summaries import (show_cache_info, show_demo, show_demo_step, show_eval, show_extract, show_extract_dry,
                                   show_generate, show_report, show_report_redraw, show_target_info, show_train,
                                   show_verify)
from stages.report import follow_report, run_report

# The other stages import torch at import time (a second or more), so each command imports its own
# stage when it runs: `pipeline --help` and a mistyped option answer at once. Nothing imported above
# pulls in torch (tests/command_line/test_layers.py checks it).

# Nothing in this tool downloads at run time: targets, tokenizers and data are local paths.
# Set before anything imports huggingface_hub (through transformers), which reads it once, at import.
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


def _user_errors(exit_code: int = 1):
    """Render a PipelineError as one line on stderr and exit `exit_code` (tracebacks only with
    --debug); verify-cache exits 2 on them, keeping 1 for a check that failed."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                apply_threads(_state["threads"])
                result = fn(*args, **kwargs)
                if "torch.distributed" in sys.modules:  # a torchrun job: leave it as it should (pipeline/distributed.py)
                    from pipeline.distributed import finish_distributed
                    finish_distributed()
                return result
            except PipelineError as e:
                if _state["debug"]:
                    raise
                error(str(e))
                raise typer.Exit(exit_code) from None
            except OSError as e:
                # A full disk or a quota can strike any write (a log line, a lock file): one line
                # naming the file, not a traceback. Other OS errors keep theirs: they may be bugs.
                if _state["debug"] or e.errno not in STORAGE_ERRNOS:
                    raise
                error(f"{e.filename or 'a write'}: {describe_os_error(e)}")
                raise typer.Exit(exit_code) from None
        return wrapper
    return decorate


JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")]


@app.command()
@_user_errors()
@config_options(ExtractConfig)
def extract(
    overrides: dict,
    shards: Annotated[Optional[str], typer.Option(help="Shards this invocation writes, e.g. '0-63' or '3,5,8-11' (default: all).")] = None,
    config: Annotated[Optional[Path], typer.Option(help="TOML config (\\[extract] table); default ./extract.toml if present, else the embedded default.")] = None,
    thinking: Annotated[Optional[bool], typer.Option("--thinking/--no-thinking", help="Render with the template's thinking mode on or off (chat_template_kwargs.enable_thinking; default: the template's own default).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the bill instead: rows, tokens, samples per shard, bytes and files, from the data, the target's config and tokenizer (no weights loaded, nothing written).")] = False,
    assume_tokens_per_s: Annotated[Optional[float], typer.Option(help="With --dry-run: extraction rate to turn tokens into time (measure it on a pilot shard).")] = None,
    assume_compression: Annotated[float, typer.Option(help="With --dry-run: stored / raw bytes (default 1.0, an upper bound); `pipeline cache-info` of a pilot shard prints it as stored_vs_raw.")] = 1.0,
    json_out: JsonOpt = False,
) -> None:
    """Run the target once and write the sharded, checksummed hidden-state cache."""
    from stages.extract import run_extract, run_extract_dry  # heavy: imports torch; keeps `pipeline --help` fast

    if config is None and Path("extract.toml").is_file():
        config = Path("extract.toml")
    if thinking is not None:
        base = load_config(ExtractConfig, config, {}, section="extract").chat_template_kwargs
        overrides["chat_template_kwargs"] = {**base, "enable_thinking": thinking}
    cfg = load_config(ExtractConfig, config, overrides, section="extract")
    if dry_run:
        show_extract_dry(run_extract_dry(cfg, shards, assume_tokens_per_s=assume_tokens_per_s,
                                         assume_compression=assume_compression, progress=not json_out), json_out)
        return
    if assume_tokens_per_s is not None or assume_compression != 1.0:
        raise PipelineError("--assume-tokens-per-s and --assume-compression go with --dry-run")
    summary = run_extract(cfg, shards, progress=not json_out)
    if summary["rank"] == 0:
        show_extract(summary, json_out)


@app.command()
@_user_errors()
@config_options(TrainConfig)
def train(
    overrides: dict,
    config: Annotated[Optional[Path], typer.Option(help="TOML config (\\[train] table), overridden by the options given here; default ./train.toml if present.")] = None,
    resume: Annotated[bool, typer.Option(help="Resume from the last complete checkpoint in --out.")] = True,
    json_out: JsonOpt = False,
) -> None:
    """Train a DFlash drafter from a cache alone (torchrun for data parallel)."""
    from pipeline.distributed import launched_rank  # heavy: imports torch; keeps `pipeline --help` fast
    from stages.train import resolve_config, run_train  # heavy: imports torch; keeps `pipeline --help` fast

    if config is None and Path("train.toml").is_file():
        config = Path("train.toml")
    cfg, preset_target = resolve_config(config, overrides)
    rank0 = launched_rank() == 0
    summary = run_train(cfg, preset_target=preset_target, resume=resume, view=TrainView(rank0 and not json_out),
                        warn=warning)
    if not rank0:
        return
    show_train(summary, json_out)


@app.command()
@_user_errors()
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
    from pipeline.distributed import launched_rank  # heavy: imports torch; keeps `pipeline --help` fast
    from stages.generate import run_generate  # heavy: imports torch; keeps `pipeline --help` fast

    with ProgressBar("generate", "rows", total=0, enabled=not json_out and launched_rank() == 0) as bar:
        result = run_generate(data=data, out=out, target=target, server=server, model=model, concurrency=concurrency,
                              shards=shards, num_shards=num_shards, turns=turns,
                              max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                              batch_size=batch_size, device=device, dtype=dtype, on_error=on_error,
                              progress=bar.advance, on_total=bar.set_total, warn=warning)
    show_generate(result, json_out)


@app.command("eval")
@_user_errors()
def eval_(
    drafter: Annotated[Path, typer.Option(help="Drafter export (RUN/drafter) or its run directory.")] = Path("dflash-run"),
    target: Annotated[Optional[Path], typer.Option(help="Target model directory (default: the one the run trained against, else the embedded target).")] = None,
    prompts: Annotated[Optional[Path], typer.Option(help="JSONL conversations; the prompt is everything before the last assistant turn (default: the embedded held-out set).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt at most.")] = 96,
    block_size: Annotated[Optional[int], typer.Option(help="Draft block size (default: the drafter's).")] = None,
    tree_budget: Annotated[str, typer.Option(help="DDTree node budgets, comma-separated ('' for none).")] = "16,64",
    tree_top_k: Annotated[int, typer.Option(help="Candidates per draft position for DDTree.")] = 8,
    report_to: Annotated[Optional[str], typer.Option(help=f"Also send the figures (taus, tau_walk with --cache) to the training run's trackers, as eval/... at its last step: {', '.join(TRACKERS)}.")] = None,
    tree_verify: Annotated[str, typer.Option(help="How a DDTree is verified: 'auto' (by the target's size; recorded in the result), 'tree' (each node once: ancestor mask, per-node recurrent states; faster where the target's compute dominates) or 'paths' (root-to-leaf paths as batch rows; faster on tiny targets, and for attention implementations that take no mask).")] = "auto",
    batch_size: Annotated[int, typer.Option(help="Prompts decoded together, one target pass per step for all of them, in every variant and in the plain reference (each prompt still checked against its own greedy tokens); worth it on a GPU.")] = 1,
    limit: Annotated[Optional[int], typer.Option(help="Only the first N prompts.")] = None,
    cache: Annotated[Optional[str], typer.Option(help="A cache (directory or s3://BUCKET/PREFIX) of the same conversations: also report the teacher-forced avg_streak + 1 on their last assistant turns.")] = None,
    device: Annotated[str, typer.Option(help="'auto' (the GPU when there is one), 'cpu', 'cuda' or 'cuda:N'.")] = "auto",
    dtype: Annotated[str, typer.Option(help="Target and drafter dtype: 'auto' (bfloat16 on a GPU, float32 on the CPU), 'float32' or 'bfloat16'.")] = "auto",
    group_by: Annotated[Optional[str], typer.Option(help="Also report tau per value of this row field (e.g. category or source); tau per kind of turn (thinking, non-thinking, tool call) is always reported.")] = None,
    temperature: Annotated[float, typer.Option(help="0: greedy (default). > 0: speculative sampling at this temperature (lossless in distribution; the baseline is plain sampling), the target's and the drafter's distributions warped alike.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Sampling: keep the most likely tokens whose mass reaches this (1: off).")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sampling: keep the K most likely tokens (0: off).")] = 0,
    seed: Annotated[int, typer.Option(help="Sampling: the seed; a prompt's random numbers depend on it and the prompt's index only, so --batch-size does not change the tokens.")] = 0,
    outputs: Annotated[Optional[Path], typer.Option(help="Also write what was decoded, a JSON line per prompt: its number, kind of turn, the reference's and every variant's ids and text, each variant's accepted draft tokens per verify step and (greedy) where it departed from greedy, at a tie or not. Written as each batch of prompts finishes, to FILE.partial (tail -f it), renamed to FILE when every prompt is in.", metavar="FILE")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Real speculative decoding with the live target: acceptance length tau for DFlash blocks and
    DDTree trees. Greedy by default, checked token for token against plain greedy decoding; with
    --temperature, speculative sampling against plain sampling."""
    from stages.eval import run_eval  # heavy: imports torch; keeps `pipeline --help` fast

    budgets = int_list(tree_budget, "--tree-budget")
    with ProgressBar("eval", "prompts", total=0, enabled=not json_out) as bar:
        result = run_eval(drafter, target=target, prompts=prompts, max_new_tokens=max_new_tokens, block_size=block_size,
                          tree_budgets=budgets, tree_top_k=tree_top_k, limit=limit, cache=cache, progress=bar.advance,
                          device=device, dtype=dtype, tree_verify=tree_verify, batch_size=batch_size, warn=warning,
                          report_to=report_to, on_total=bar.set_total, group_by=group_by, temperature=temperature,
                          top_p=top_p, top_k=top_k, seed=seed, outputs=outputs)
    show_eval(result, json_out)
    if result["lossless"] is False:
        raise typer.Exit(1)


@app.command()
@_user_errors()
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
    eval_file: Annotated[Optional[Path], typer.Option("--eval", help="A `pipeline eval --json` result: its decoded tau, pooled and per kind of turn (thinking / non-thinking / tool call), beside the verdicts, with a plot.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Convergence diagnostics: rolling means with confidence intervals, plateau/regression
    verdicts, cliffs, grad-norm anomalies, extrapolation, run-vs-run comparison, plots; with
    --eval, the decoded tau per kind of turn."""
    options = {"window_size": window, "every": every, "epochs": epochs, "steps_per_epoch": steps_per_epoch,
               "reference_tau": reference_tau, "plots": out, "eval_file": eval_file}
    if follow:
        if interval <= 0:
            raise PipelineError(f"--interval must be > 0, got {interval}")
        follow_report(logs, interval=interval, show=lambda result: show_report_redraw(result, json_out), **options)
        return
    show_report(run_report(logs, **options), json_out)


@app.command("verify-cache")
@_user_errors(exit_code=2)
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
    from pipeline.verify.sample_view import show_sample  # heavy: imports torch; keeps `pipeline --help` fast
    from stages.verify import run_verify  # heavy: imports torch; keeps `pipeline --help` fast

    shown = show_sample(cache, show, target) if show is not None else None
    if shown is not None and not json_out:
        print_sample(shown)
    result = run_verify(cache, shards=shards, target=target, recompute=recompute, tail_rate=tail_rate,
                        sample_rate=sample_rate, seed=seed, device=device, dtype=dtype, progress=not json_out)
    if shown is not None:
        result["sample"] = shown
    show_verify(result, json_out)
    raise typer.Exit(0 if result["passed"] else 1)


@app.command()
@_user_errors()
def demo(
    out: Annotated[Path, typer.Option(help="Folder for everything the demo writes.")] = Path("dflash-demo"),
    quick: Annotated[bool, typer.Option(help="A one-minute version (fewer conversations, steps and prompts).")] = False,
    report_to: Annotated[Optional[str], typer.Option(help="Experiment trackers for the training step (as `train --report-to`).")] = None,
    block_size: Annotated[Optional[int], typer.Option(help="The drafter's block size (default: the tiny preset's 8; 16 is the flagship's and takes longer, BENCHMARKS.md).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """The whole pipeline on the embedded tiny target: extract, verify, train, speculative-decoding
    eval, report. About 5 minutes on 2 CPU cores; re-running resumes."""
    from stages.demo import run_demo  # heavy: imports torch; keeps `pipeline --help` fast

    summary = run_demo(out, quick=quick, progress=not json_out, report_to=report_to, block_size=block_size,
                       say=show_demo_step)
    show_demo(summary, json_out)


@app.command("cache-info")
@_user_errors()
def cache_info(
    cache: Annotated[str, typer.Argument(help="Cache: a directory, file://PATH or s3://BUCKET/PREFIX.")],
    draft_vocab: Annotated[Optional[str], typer.Option(help="Also read the labels and report the coverage of a draft vocabulary of each K, comma-separated (e.g. 32768,65536), as `pipeline train --draft-vocab K` would choose it.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """What a cache holds, from its records alone (no array is read): identity, completeness,
    kernel provenance per shard, hosts, environments, counts, bytes per token."""
    from stages.cache_info import run_cache_info  # imports zarr; keeps `pipeline --help` fast

    sizes = None
    if draft_vocab is not None:
        try:
            sizes = [int(x) for x in draft_vocab.split(",") if x.strip()]
        except ValueError:
            raise PipelineError(f"--draft-vocab: expected sizes like 32768,65536, got {draft_vocab!r}") from None
    show_cache_info(run_cache_info(cache, sizes), json_out)


@app.command("target-info")
@_user_errors()
def target_info(
    path: Annotated[Optional[Path], typer.Argument(help="Target model directory (default: the embedded tiny target).")] = None,
    data: Annotated[Optional[Path], typer.Option(help="JSONL conversations the target generated, for a self-agreement check.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Summarise a target model directory: class, layers, taps, tokenizer, chat template."""
    from stages.target_info import target_summary  # heavy: imports torch; keeps `pipeline --help` fast

    build = None
    if path is None:
        path, data, build = TARGET_DIR, data or HELDOUT_DATA, BUILD_REPORT
    show_target_info(target_summary(path, heldout=data, build_report=build), json_out)


if __name__ == "__main__":
    app()
