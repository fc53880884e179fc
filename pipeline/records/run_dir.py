"""A training run directory's layout (`pipeline train --out RUN`), named once: every command that
writes or reads a file of a run (train, its checkpoints and claim, the trackers, eval, report, the
demo) asks `RunDir` where it is, so a name cannot drift between its writer and its readers (the
benchmarks, which measure rather than ship, may spell a path themselves).

    RUN/
      drafter/                  the export (DESIGN 8: config.json + model.safetensors), written at the end
      checkpoints/
        step-00000500/          one complete checkpoint (`CheckpointDir`): drafter/, optimizer.pt,
                                rng.pt, trainer_state.json
        .step-00000500.tmp-PID  one being written; renamed to step-N when complete, removed by the next save
      run.json                  what the run was (records/run.py), written at every start and resume
      train_log.jsonl           a line per logged step (records/train_log.py)
      verdicts.jsonl            the live verdicts it fired (records/verdicts.py)
      owner.json, .owner.lock   who trains into RUN now (training/run_claim.py)
      trackers.json             each tracker's run id, so a resumed run continues it (tracking/)
      tensorboard/              TensorBoard's event files
      mlflow.db, mlartifacts/   MLflow's own store, when $MLFLOW_TRACKING_URI is not set
      wandb/                    W&B's offline runs (W&B names it itself under the directory it is given,
                                RUN; no property here)
      report/                   `pipeline report`'s PNG plots of the run, unless --out puts them elsewhere

The README (Training: Output, One training per run directory; Trackers) promises these names, and
tests/training/test_run_dir.py holds the two to each other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_CHECKPOINT = re.compile(r"^step-(\d{8})$")


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    @classmethod
    def holding(cls, path: Path) -> RunDir:
        """The run directory a file or folder of it sits in (its train_log.jsonl, its drafter/)."""
        return cls(Path(path).parent)

    @property
    def drafter(self) -> Path:
        return self.path / "drafter"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:08d}"

    @staticmethod
    def checkpoint_step(path: Path) -> int | None:
        """The step of a complete checkpoint's directory; None for anything else there (a temporary)."""
        found = _CHECKPOINT.match(Path(path).name)
        return int(found.group(1)) if found else None

    def checkpoint_temporary(self, step: int, pid: int) -> Path:
        """Where process `pid` writes the checkpoint of `step` before renaming it complete."""
        return self.checkpoints / f".{self.checkpoint(step).name}.tmp-{pid}"

    def checkpoint_temporaries(self) -> list[Path]:
        """Checkpoints left half-written (by a process that died or failed mid-write)."""
        return list(self.checkpoints.glob(".step-*.tmp*"))

    @property
    def run_record(self) -> Path:
        return self.path / "run.json"

    @property
    def train_log(self) -> Path:
        return self.path / "train_log.jsonl"

    @property
    def verdicts(self) -> Path:
        return self.path / "verdicts.jsonl"

    @property
    def owner(self) -> Path:
        """The claim's record: who trains into RUN now."""
        return self.path / "owner.json"

    @property
    def owner_lock(self) -> Path:
        """The claim's flock."""
        return self.path / ".owner.lock"

    @property
    def tracker_ids(self) -> Path:
        return self.path / "trackers.json"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def mlflow_store(self) -> Path:
        return self.path / "mlflow.db"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.path / "mlartifacts"

    @property
    def report(self) -> Path:
        """`pipeline report`'s plots by default: beside the log they draw, never in whatever
        directory the command was run from (a checkout's root collected them once)."""
        return self.path / "report"


@dataclass(frozen=True)
class CheckpointDir:
    """One checkpoint (RUN/checkpoints/step-N, or its temporary while it is written)."""
    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    @property
    def drafter(self) -> Path:
        return self.path / "drafter"

    @property
    def optimizer(self) -> Path:
        return self.path / "optimizer.pt"

    @property
    def rng(self) -> Path:
        return self.path / "rng.pt"

    @property
    def trainer_state(self) -> Path:
        return self.path / "trainer_state.json"
