"""`pipeline report LOG [LOG ...]`: convergence diagnostics for drafter training logs.

Per run: rolling-window means with 95% confidence intervals at step checkpoints and at epoch
fractions; the change per half-epoch with its z; a plateau / improving / regressing verdict per
metric from the last window against the one before; cliffs (sudden moves in the bad direction)
and grad-norm anomalies; each metric extrapolated to the end of training. Several runs: their
window means side by side at common steps, with the leader and whether its margin exceeds the
noise. Missing keys are counted and reported, never averaged as zero. PNG plots per metric group.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.report.logs import DIRECTION, GROUPS, QUALITY, Run, read_run
from pipeline.report.stats import anomalies, cliffs, compare, extrapolate, window

METRICS = QUALITY + ["grad_norm", "lr"]


def _window_at(run: Run, metric: str, step: float, size: int) -> dict | None:
    steps, values = run.series(metric)
    picked = [v for s, v in zip(steps, values) if s <= step][-size:]
    return window(picked)


def _checkpoint_steps(run: Run, every: int | None) -> list[float]:
    last = run.last_step
    if not every:
        raw = last / 8
        magnitude = 10 ** math.floor(math.log10(max(raw, 1)))
        every = max(1, int(round(raw / magnitude) * magnitude))
    return [float(s) for s in range(every, int(last) + 1, every)] or [last]


def _final_step(run: Run, epochs: float | None) -> float:
    if epochs and run.steps_per_epoch:
        return epochs * run.steps_per_epoch
    config = run.path.parent / "run.json"
    if config.is_file():
        try:
            return float(json.loads(config.read_text())["plan"]["total_steps"])
        except (KeyError, ValueError, json.JSONDecodeError):
            pass
    return run.last_step


def analyse(run: Run, *, size: int, every: int | None, epochs: float | None) -> dict:
    out: dict = {"name": run.name, "path": str(run.path), "entries": len(run.records), "last_step": run.last_step,
                 "steps_per_epoch": run.steps_per_epoch, "window": size,
                 "missing": {m: run.missing(m) for m in METRICS if run.missing(m)}}
    points = [("step", s) for s in _checkpoint_steps(run, every)]
    if run.steps_per_epoch:
        fraction = 0.5
        while fraction * run.steps_per_epoch <= run.last_step:
            points.append(("epoch", fraction))
            fraction += 0.5
    out["checkpoints"] = []
    for kind, value in points:
        step = value if kind == "step" else value * run.steps_per_epoch
        row = {"at": f"{kind} {value:g}", "step": step}
        for metric in METRICS:
            w = _window_at(run, metric, step, size)
            row[metric] = w if w else "missing"
        out["checkpoints"].append(row)

    out["verdicts"], out["half_epochs"], out["cliffs"], out["extrapolated"] = {}, {}, [], {}
    final = _final_step(run, epochs)
    out["final_step"] = final
    for metric in METRICS:
        steps, values = run.series(metric)
        if not values:
            out["verdicts"][metric] = {"verdict": "missing"}
            continue
        if len(values) >= 4:
            half = min(size, len(values) // 2)
            last, prev = window(values[-half:]), window(values[-2 * half:-half])
            out["verdicts"][metric] = {**compare(prev, last, DIRECTION.get(metric, 0)), "window": half,
                                       "last_mean": last["mean"]}
        else:
            out["verdicts"][metric] = {"verdict": "too few entries", "n": len(values)}
        if run.steps_per_epoch and metric in QUALITY:
            half_epoch = run.steps_per_epoch / 2
            segments: dict[int, list[float]] = {}
            for s, v in zip(steps, values):
                segments.setdefault(int((s - 1) // half_epoch), []).append(v)
            rows, previous = [], None
            for k in sorted(segments):
                w = window(segments[k])
                row = {"from_epoch": k / 2, "to_epoch": (k + 1) / 2, "mean": w["mean"], "n": w["n"]}
                if previous is not None and previous["n"] > 1 and w["n"] > 1:
                    row.update(compare(previous, w, DIRECTION[metric]))
                rows.append(row)
                previous = w
            out["half_epochs"][metric] = rows
        if metric in QUALITY:
            out["cliffs"] += [{"metric": metric, **c} for c in cliffs(steps, values, DIRECTION[metric],
                                                                       before=min(20, max(3, len(values) // 5)))]
            value = extrapolate(steps, values, final)
            if value is not None:
                value = max(value, 0.0)
                if metric not in ("loss", "avg_streak", "ddtree_streak4", "ddtree_streak8"):
                    value = min(value, 1.0)
            out["extrapolated"][metric] = value
    # The first tenth of the log is left out: gradients at initialisation are large by nature.
    raw = [(r["step"], r.get("grad_norm")) for r in run.records if isinstance(r.get("grad_norm"), (int, float))]
    raw = raw[len(raw) // 10:]
    out["grad_norm_anomalies"] = anomalies([s for s, _ in raw], [float(v) for _, v in raw]) if raw else []
    out["extrapolation_method"] = ("least squares of the metric on log(step) over the second half of the log, "
                                   f"evaluated at step {final:g} (the end of training)")
    return out


def compare_runs(runs: list[Run], *, size: int, every: int | None) -> list[dict]:
    """Window means of every run at checkpoint steps all runs reached; the leader per metric and
    whether its margin exceeds the two windows' combined noise (z >= 2)."""
    shortest = min(runs, key=lambda r: r.last_step)
    rows = []
    for step in _checkpoint_steps(shortest, every):
        row = {"step": step}
        for metric in QUALITY:
            windows = {r.name: _window_at(r, metric, step, size) for r in runs}
            present = {k: w for k, w in windows.items() if w}
            entry = {"means": {k: (w["mean"] if w else "missing") for k, w in windows.items()}}
            if len(present) >= 2:
                ordered = sorted(present.items(), key=lambda kv: kv[1]["mean"] * DIRECTION[metric], reverse=True)
                (lead, a), (second, b) = ordered[0], ordered[1]
                z = compare(b, a, 1)["z"] if (a["se"] or b["se"]) else math.inf
                entry.update(leader=lead, runner_up=second, margin=abs(a["mean"] - b["mean"]), significant=abs(z) >= 2)
            row[metric] = entry
        rows.append(row)
    return rows


def plot(runs: list[Run], out_dir: Path, size: int) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for group, metrics in GROUPS.items():
        fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.6), squeeze=False)
        for ax, metric in zip(axes[0], metrics):
            for run in runs:
                steps, values = run.series(metric)
                if not values:
                    continue
                line, = ax.plot(steps, values, alpha=0.25, linewidth=0.8)
                k = max(1, min(size, len(values) // 10 or 1))
                smooth = [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]
                ax.plot(steps, smooth, color=line.get_color(), linewidth=1.8, label=run.name)
            ax.set_title(metric)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if metric == "lr":
                ax.set_yscale("log")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"report-{group}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written


def run_report(logs: list[Path], *, window_size: int | None, every: int | None, epochs: float | None,
               steps_per_epoch: float | None, reference_tau: float | None, plots: Path | None) -> dict:
    if not logs:
        raise PipelineError("give at least one train_log.jsonl")
    runs = [read_run(Path(p) / "train_log.jsonl" if Path(p).is_dir() else Path(p), steps_per_epoch) for p in logs]
    names = [r.name for r in runs]
    for i, r in enumerate(runs):
        if names.count(r.name) > 1:
            r.name = f"{r.name}#{i + 1}"
    size = window_size or min(200, max(5, min(len(r.records) for r in runs) // 8))
    result = {"window": size, "runs": [analyse(r, size=size, every=every, epochs=epochs) for r in runs]}
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
    if plots is not None:
        result["plots"] = plot(runs, plots, size)
    return result


def _log_path(path: Path) -> Path:
    path = Path(path)
    return path / "train_log.jsonl" if path.is_dir() else path


def run_finished(log: Path) -> bool:
    """A run is over when its log reached the plan's last step (run.json beside the log)."""
    log = _log_path(log)
    try:
        total = json.loads((log.parent / "run.json").read_text())["plan"]["total_steps"]
        lines = log.read_text(encoding="utf-8").splitlines()
        return bool(lines) and json.loads(lines[-1]).get("step", 0) >= total
    except (OSError, KeyError, ValueError, json.JSONDecodeError):
        return False


def follow_report(logs: list[Path], *, interval: float, show, timeout: float | None = None, **options) -> dict:
    """`pipeline report --follow`: the report again (`show(result)`, plots rewritten) each time a
    log grows, checked every `interval` seconds, until every run has reached its last step (or
    `timeout` seconds pass). A log that does not exist yet is waited for."""
    import time

    start, seen, result = time.monotonic(), None, None
    while True:
        paths = [_log_path(p) for p in logs]
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
