"""Train logs as the report sees them: a run's lines sorted by step (read by pipeline/records/
train_log.py: a torn last line tolerated, anything else malformed an error naming file:line,
missing keys missing), the metrics' directions and groups."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.records.run import read_run_record
from pipeline.records.run_dir import RunDir
from pipeline.records.train_log import LogLine, last_step, read_train_log

# Metric -> which direction is better (+1 higher, -1 lower, 0 neither).
DIRECTION = {"loss": -1, "ce": -1, "accuracy": 1, "top4_acc": 1, "top8_acc": 1, "avg_streak": 1, "ddtree_streak4": 1,
             "ddtree_streak8": 1, "grad_norm": 0, "lr": 0, "tok_per_sec": 1, "noise_std": 0}
# `ce` beside `loss`: the one loss figure that means the same in runs of different objectives.
GROUPS = {"loss": ["loss", "ce"], "accuracy": ["accuracy", "top4_acc", "top8_acc"],
          "streaks": ["avg_streak", "ddtree_streak4", "ddtree_streak8"], "optimisation": ["lr", "grad_norm"]}
QUALITY = ["loss", "ce", "accuracy", "top4_acc", "top8_acc", "avg_streak", "ddtree_streak4", "ddtree_streak8"]
# The smallest bad move that counts as a cliff, whatever the spread before it: rates and streaks
# near zero move by large fractions of themselves on noise alone (a run with random labels, at
# chance accuracy, "fell" from 0.0027 to 0.0014 and was called a cliff).
CLIFF_FLOOR = {"accuracy": 0.01, "top4_acc": 0.01, "top8_acc": 0.01, "avg_streak": 0.05, "ddtree_streak4": 0.05,
               "ddtree_streak8": 0.05}


@dataclass
class Run:
    name: str
    path: Path
    records: list[LogLine]
    steps_per_epoch: float | None

    def series(self, metric: str) -> tuple[list[float], list[float]]:
        """(steps, values) of the records that carry `metric` as a finite number."""
        steps, values = [], []
        for r in self.records:
            v = r.get(metric)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                steps.append(float(r.step))
                values.append(float(v))
        return steps, values

    def missing(self, metric: str) -> int:
        return sum(1 for r in self.records if not isinstance(r.get(metric), (int, float)))

    @property
    def last_step(self) -> float:
        return float(self.records[-1].step)


def read_run(path: Path, steps_per_epoch: float | None = None) -> Run:
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"{path}: no such log file")
    records = sorted(read_train_log(path), key=lambda r: r.step)
    if not records:
        raise PipelineError(f"{path}: no log entries")
    if steps_per_epoch is None:
        found = [r.steps_per_epoch for r in records if isinstance(r.steps_per_epoch, (int, float))]
        steps_per_epoch = float(found[-1]) if found else None
    return Run(path.parent.name if path == RunDir.holding(path).train_log else path.stem, path, records, steps_per_epoch)


def log_path(path: Path) -> Path:
    path = Path(path)
    return RunDir(path).train_log if path.is_dir() else path


def run_finished(log: Path) -> bool:
    """A run is over when its log reached the plan's last step (run.json beside the log)."""
    log = log_path(log)
    try:
        total = read_run_record(RunDir.holding(log).run_record).total_steps
        last = last_step(log)
        return last is not None and last >= total
    except (OSError, PipelineError, KeyError, TypeError, ValueError):
        return False


def draft_vocab_of(log: Path) -> dict | None:
    """The draft vocabulary the run beside `log` trained with (run.json's record), None without one
    or without a readable run.json."""
    return _run_record_field(log, "draft_vocab")


def tap_projection_of(log: Path) -> dict | None:
    """The basis of the projected cache the run beside `log` trained on (run.json), or None."""
    return _run_record_field(log, "tap_projection")


def _run_record_field(log: Path, name: str):
    try:
        return getattr(read_run_record(RunDir.holding(log_path(log)).run_record), name)
    except PipelineError:
        return None
