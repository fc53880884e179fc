"""`pipeline report`'s options, each declared once: the field is the flag, its default and its help."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import option
from stages.options import JsonOutput


@dataclass(kw_only=True)
class ReportOptions(JsonOutput):
    logs: list[Path] = option(argument=True, help="train_log.jsonl files or run directories; several are compared.")
    window: int | None = option(None, help="Entries per rolling window (default: 200, at most an eighth of the shortest log).")
    every: int | None = option(None, help="Steps between checkpoints (default: about 8 per run).")
    epochs: float | None = option(None, help="Epochs of the full run, for extrapolation (default: the run's plan, else the last step).")
    steps_per_epoch: float | None = option(None, help="Steps per epoch, if the log does not record it.")
    reference_tau: float | None = option(None, help="Acceptance length of a reference drafter to hold the extrapolated tau against.")
    out: Path | None = option(None, help="Folder for the PNG plots (default: report/ in the run directory of the first log given, RUN/report).")
    follow: bool = option(False, help="Re-draw the report (and the plots) as the logs grow, until every run reaches its last step; with --json, one JSON document per line per re-draw.")
    interval: float = option(10.0, help="With --follow: seconds between looks at the logs.")
    eval_file: Path | None = option(None, flag="--eval", help="A `pipeline eval --json` result: its decoded tau, pooled and per kind of turn (thinking / non-thinking / tool call), beside the verdicts, with a plot.")
