"""`pipeline report LOG [LOG ...]`: convergence diagnostics for drafter training logs.

Per run: rolling-window means with 95% confidence intervals at step checkpoints and at epoch
fractions; the change per half-epoch with its z; a plateau / improving / regressing verdict per
metric from the last window against the one before; cliffs (sudden moves in the bad direction)
and grad-norm anomalies; each metric extrapolated to the end of training. Several runs: their
window means side by side at common steps, with the leader and whether its margin exceeds the
noise. Missing keys are counted and reported, never averaged as zero. PNG plots per metric group.
With `--eval EVAL_JSON` (what `pipeline eval --json` or the demo's eval.json holds): the decoded
tau beside the training verdicts, pooled and per kind of turn (thinking, non-thinking, tool call),
with a plot of the kinds.
"""

from __future__ import annotations

import time
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.records.eval_result import read_decoded_taus
from pipeline.report.analysis import analyse, compare_runs
from pipeline.records.run_dir import RunDir
from pipeline.report.logs import draft_vocab_of, log_path, read_run, run_finished, tap_projection_of
from pipeline.report.plots import plot, plot_kinds


def default_plots_folder(logs: list[Path]) -> Path:
    """Where the plots go without --out: report/ in the run directory of the first log given
    (the folder holding it, for a log file outside one); runs compared are drawn there together."""
    if not logs:
        raise PipelineError("give at least one train_log.jsonl")
    return RunDir.holding(log_path(logs[0])).report


def run_report(logs: list[Path], *, window_size: int | None, every: int | None, epochs: float | None,
               steps_per_epoch: float | None, reference_tau: float | None, plots: Path | None,
               eval_file: Path | None = None) -> dict:
    if not logs:
        raise PipelineError("give at least one train_log.jsonl")
    decoded = read_decoded_taus(Path(eval_file)) if eval_file is not None else None
    runs = [read_run(log_path(p), steps_per_epoch) for p in logs]
    names = [r.name for r in runs]
    for i, r in enumerate(runs):
        if names.count(r.name) > 1:
            r.name = f"{r.name}#{i + 1}"
    size = window_size or min(200, max(5, min(len(r.records) for r in runs) // 8))
    result = {"window": size, "runs": [analyse(r, size=size, every=every, epochs=epochs) for r in runs]}
    for r, analysed in zip(runs, result["runs"]):
        vocab = draft_vocab_of(r.path)
        if vocab:  # what the run drafts from, and the share of its labels outside that (last log line)
            outside = [x.outside_vocab for x in r.records if isinstance(x.outside_vocab, (int, float))]
            analysed["draft_vocab"] = {"size": vocab.get("size"), "target_size": vocab.get("target_size"),
                                       "coverage": vocab.get("coverage"), "outside_vocab_last": outside[-1] if outside else None}
        projection = tap_projection_of(r.path)
        if projection:  # what fc read: the cache's taps projected to R values a token
            analysed["tap_projection"] = {k: projection.get(k) for k in ("rank", "energy", "pilot_tokens", "digest")}
    if reference_tau is not None:
        for r in result["runs"]:
            streak = r["extrapolated"].get("avg_streak")
            r["reference"] = {"reference_tau": reference_tau,
                              "extrapolated_tau": None if streak is None else streak + 1,
                              "gap": None if streak is None else streak + 1 - reference_tau,
                              "note": "tau = avg_streak + 1 from teacher-forced training metrics; it overestimates "
                                      "the acceptance measured by `pipeline eval` (see BENCHMARKS.md)"}
    if len(runs) > 1:
        result["comparison"] = compare_runs(runs, size=size, every=every)
    if decoded is not None:
        result["eval"] = decoded
    if plots is not None:
        result["plots"] = plot(runs, plots, size)
        if decoded is not None and decoded["by_kind"]:
            result["plots"].append(plot_kinds(decoded, plots))
    return result


def follow_report(logs: list[Path], *, interval: float, show, timeout: float | None = None, **options) -> dict:
    """`pipeline report --follow`: the report again (`show(result)`, plots rewritten) each time a
    log grows, checked every `interval` seconds, until every run has reached its last step (or
    `timeout` seconds pass). A log that does not exist yet is waited for."""
    start, seen, result = time.monotonic(), None, None
    while True:
        paths = [log_path(p) for p in logs]
        # Whether the runs are over is read before the sizes, so the last re-draw covers the end.
        finished = all(run_finished(p) for p in paths)
        sizes = tuple(p.stat().st_size if p.is_file() else -1 for p in paths)
        if sizes != seen and all(size > 0 for size in sizes):
            try:
                result = run_report(logs, **options)
            except PipelineError:
                result = None  # a log with no complete line yet: wait for the next one
            else:
                seen = sizes
                show(result)
        if finished and sizes == seen:
            return result
        if timeout is not None and time.monotonic() - start > timeout:
            raise PipelineError(f"--follow: the runs did not finish within {timeout:g} s")
        time.sleep(interval)
