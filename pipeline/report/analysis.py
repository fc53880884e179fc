"""Convergence diagnostics of training logs: rolling-window means with 95% confidence intervals
at step checkpoints and epoch fractions, the change per half-epoch with its z, a plateau /
improving / regressing verdict per metric, cliffs, grad-norm anomalies, each metric extrapolated
to the end of training; and several runs compared at common steps."""

from __future__ import annotations

import math

from pipeline.errors import PipelineError
from pipeline.records.run import read_run_record
from pipeline.records.run_dir import RunDir
from pipeline.report.logs import CLIFF_FLOOR, DIRECTION, QUALITY, Run
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
    recorded = RunDir.holding(run.path).run_record
    if recorded.is_file():
        try:
            return float(read_run_record(recorded).total_steps)
        except (PipelineError, KeyError, TypeError, ValueError):
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
                                                                       before=min(20, max(3, len(values) // 5)),
                                                                       floor=CLIFF_FLOOR.get(metric, 0.0))]
            value = extrapolate(steps, values, final)
            if value is not None:
                value = max(value, 0.0)
                if metric not in ("loss", "ce", "avg_streak", "ddtree_streak4", "ddtree_streak8"):
                    value = min(value, 1.0)
            out["extrapolated"][metric] = value
    # The first tenth of the log is left out: gradients at initialisation are large by nature.
    raw = [(r.step, r.get("grad_norm")) for r in run.records if isinstance(r.get("grad_norm"), (int, float))]
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
