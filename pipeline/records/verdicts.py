"""RUN/verdicts.jsonl: the live verdicts a training run fired (pipeline/report/live.py), one JSON
line each with its step, cause, message and figure; appended by the training loop as they fire,
trimmed with the log on resume (train_log.trim_to_step), read by the live-verdicts benchmark."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.records.run_dir import RunDir


def append_verdict(run_dir: Path, verdict: dict) -> None:
    with open(RunDir(run_dir).verdicts, "a", encoding="utf-8") as f:
        f.write(json.dumps(verdict) + "\n")


def read_verdicts(run_dir: Path) -> list[dict]:
    """The fired verdicts in order; [] when none fired. A torn last line (a run killed mid-write)
    is left out."""
    path = RunDir(run_dir).verdicts
    if not path.exists():
        return []
    found = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return found
