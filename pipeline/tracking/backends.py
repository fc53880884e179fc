"""One class per experiment tracker, each through the tracker's own library (imported only when
the tracker is asked for: they are optional extras and slow to import). Each has
log(step, scalars), event(step, cause, message, figure), artifact(path), close(), and `run_id`
(what a resumed run needs to continue the same tracker run, or None)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import netrc
import os
import sys
from pathlib import Path
from urllib.parse import urlparse

from pipeline.errors import PipelineError
from pipeline.records.run_dir import RunDir


@contextlib.contextmanager
def _quiet():
    """Trackers' INFO logging (database creation, migrations) kept off the user's terminal."""
    logger = logging.getLogger("mlflow")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


class _Backend:
    name = ""
    module = ""
    run_id: str | None = None

    @classmethod
    def check_installed(cls) -> None:
        # Imported, not only found: a broken install fails here too, before the model loads.
        try:
            importlib.import_module(cls.module)
        except ImportError as e:
            raise PipelineError(f'--report-to {cls.name} needs the optional extra: pip install "dflash-pipeline[{cls.name}]" '
                                f"({e})") from None

    def flush(self) -> None:  # trackers that write as they go have nothing to flush
        pass

    def artifact(self, path: Path) -> None:  # trackers without artifacts keep nothing
        pass

    def abandon(self) -> None:  # stop without the closing writes (Trackers.abandon): nothing to skip
        pass


class TensorBoard(_Backend):
    """Event files under RUN/tensorboard. On resume, events past the resumed step are purged
    (the resumed run logs those steps again), so the curves have no doubled stretch."""

    name, module = "tensorboard", "tensorboard"

    def __init__(self, *, run_dir: Path, run_name: str, params: dict, start_step: int, previous_id: str | None):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = RunDir(run_dir).tensorboard
        # Flushed by the writer's thread every 5 s (a flush per log line cost ~0.5 ms each).
        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=start_step + 1 if start_step else None,
                                    flush_secs=5)
        if not start_step:
            table = "| parameter | value |\n|---|---|\n" + "".join(
                f"| {k} | {str(v).replace('|', '/')} |\n" for k, v in sorted(params.items()))
            self.writer.add_text("run/parameters", table, 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def event(self, step: int, cause: str, message: str, figure: float | None) -> None:
        self.writer.add_text(f"verdicts/{cause}", message, step)
        if figure is not None:
            self.writer.add_scalar(f"verdicts/{cause}", figure, step)
        self.writer.flush()

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    def abandon(self) -> None:
        # Not closed: closing flushes. What the writer queued after the last (guarded) flush is
        # dropped with the process; its thread is a daemon.
        self.writer = None


class MLflow(_Backend):
    """A run in $MLFLOW_TRACKING_URI, else in a SQLite store at RUN/mlflow.db with artifacts under
    RUN/mlartifacts (MLflow 3 keeps its file store in maintenance mode and refuses it by default);
    experiment "dflash" ($MLFLOW_EXPERIMENT_NAME overrides). Through MlflowClient: no global active
    run, so nothing leaks into the user's own code."""

    name, module = "mlflow", "mlflow"

    def __init__(self, *, run_dir: Path, run_name: str, params: dict, start_step: int, previous_id: str | None):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        import time

        self.buffer: list = []
        self.flushed_at = time.monotonic()
        run_dir = Path(run_dir).resolve()
        own_store = not os.environ.get("MLFLOW_TRACKING_URI")
        self.uri = f"sqlite:///{RunDir(run_dir).mlflow_store}" if own_store else os.environ["MLFLOW_TRACKING_URI"]
        with _quiet():  # MLflow logs its schema migrations to stdout-bound handlers
            self.client = MlflowClient(tracking_uri=self.uri)
            if previous_id:
                self.run_id = previous_id
                self.client.update_run(previous_id, status="RUNNING")
                return
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "dflash")
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
                name, artifact_location=RunDir(run_dir).mlflow_artifacts.as_uri() if own_store else None)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        # MLflow caps a parameter value's length; longer values are cut with a marker.
        text = {k: str(v) for k, v in params.items()}
        items = [Param(k[:250], v if len(v) <= 6000 else v[:5990] + " [cut]") for k, v in text.items()]
        for first in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[first:first + 100])

    pending = None
    FLUSH_SECONDS = 5.0
    MAX_BATCH = 900  # MLflow takes at most 1000 metrics per batch

    def log(self, step: int, scalars: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        # MLflow's SQL store costs ~13 ms of CPU per batch call whatever its size: metrics are
        # buffered and written every FLUSH_SECONDS by MLflow's async logger, at most one batch
        # outstanding; waiting on the previous batch surfaces its failure (one flush late) to
        # Trackers, which drops the tracker with a warning.
        now = int(time.time() * 1000)
        self.buffer += [Metric(k, v, now, step) for k, v in scalars.items()]
        if time.monotonic() - self.flushed_at >= self.FLUSH_SECONDS or len(self.buffer) >= self.MAX_BATCH:
            self._flush()

    def _flush(self) -> None:
        import time

        self._settle()
        batch, self.buffer = self.buffer, []
        self.flushed_at = time.monotonic()
        for first in range(0, len(batch), self.MAX_BATCH):
            if first:
                self._settle()
            self.pending = self.client.log_batch(self.run_id, metrics=batch[first:first + self.MAX_BATCH],
                                                 synchronous=False)

    def _settle(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()

    def event(self, step: int, cause: str, message: str, figure: float | None) -> None:
        self._flush()
        self._settle()
        self.client.set_tag(self.run_id, f"verdict.{cause}", f"step {step}: {message}")
        if figure is not None:
            self.log(step, {f"verdicts/{cause}": figure})

    def flush(self) -> None:
        self._flush()
        self._settle()

    def artifact(self, path: Path) -> None:
        self._flush()
        self._settle()
        self.client.log_artifacts(self.run_id, str(path), artifact_path=path.name)

    def close(self) -> None:
        self._flush()
        self._settle()
        self.client.set_terminated(self.run_id)

    def abandon(self) -> None:
        # The buffered metrics are dropped, and the run is not marked terminated (a write to
        # RUN/mlflow.db); a batch already handed to MLflow's async logger is its to finish.
        self.buffer = []


def _wandb_key_configured() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandB(_Backend):
    """A W&B run: $WANDB_MODE if set; else online when an API key is configured (WANDB_API_KEY or
    `wandb login`'s netrc entry), offline under RUN/wandb when not (`wandb sync` uploads it later).
    W&B writes through its own helper process, which has no flush to call: when a run is killed
    (SIGKILL), what it had not written yet is lost (measured: a killed 20-step segment left only
    the transaction log's header). The resumed run continues the same run id from the checkpoint,
    so W&B misses at most what was logged between the previous flush of its helper and the
    checkpoint resumed from; train_log.jsonl has every line."""

    name, module = "wandb", "wandb"

    def __init__(self, *, run_dir: Path, run_name: str, params: dict, start_step: int, previous_id: str | None):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_key_configured() else "offline")
        self.mode = mode
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dflash"), name=run_name, dir=str(run_dir),
                              config=params, mode=mode, id=previous_id, resume="allow" if previous_id else None,
                              settings=wandb.Settings(console="off", silent=True))
        self.run_id = self.run.id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def event(self, step: int, cause: str, message: str, figure: float | None) -> None:
        self.run.summary[f"verdicts/{cause}"] = f"step {step}: {message}"
        if figure is not None:
            self.run.log({f"verdicts/{cause}": figure}, step=step)
        if self.mode == "online":
            import wandb
            self.run.alert(title=f"dflash: {cause}", text=f"step {step}: {message}", level=wandb.AlertLevel.WARN)

    def artifact(self, path: Path) -> None:
        import wandb

        artifact = wandb.Artifact(f"{self.run.id}-{path.name}", type="model")
        artifact.add_dir(str(path))
        self.run.log_artifact(artifact)

    def close(self) -> None:
        self.run.finish()

    def abandon(self) -> None:
        # Not finished here. W&B's own exit hook still finishes the run through its helper process
        # (in offline mode a write under RUN/wandb): not in this process's hands, and left alone.
        pass


class Trackio(_Backend):
    """A trackio run in its local store ($TRACKIO_DIR, else trackio's default), project "dflash"
    ($TRACKIO_PROJECT overrides); trackio's own messages go to stderr, so `--json` output stays
    parseable, and its CPU/GPU sampling threads stay off (they would cost training time)."""

    name, module = "trackio", "trackio"

    def __init__(self, *, run_dir: Path, run_name: str, params: dict, start_step: int, previous_id: str | None):
        import trackio

        self.project = os.environ.get("TRACKIO_PROJECT", "dflash")
        with contextlib.redirect_stdout(sys.stderr):
            self.run = trackio.init(project=self.project, name=previous_id or run_name, config=params,
                                    resume="allow" if previous_id else "never", auto_log_gpu=False, auto_log_cpu=False)
        self.run_id = self.run.name

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def event(self, step: int, cause: str, message: str, figure: float | None) -> None:
        from trackio.alerts import AlertLevel

        with contextlib.redirect_stdout(sys.stderr):
            self.run.alert(title=cause, text=message, level=AlertLevel.WARN, step=step)
        if figure is not None:
            self.run.log({f"verdicts/{cause}": figure}, step=step)

    def artifact(self, path: Path) -> None:
        with contextlib.redirect_stdout(sys.stderr):
            self.run.log_artifact(path, name=path.name, type="model")

    def close(self) -> None:
        import trackio

        # The module-level finish also forgets the current run, so trackio's exit hook does not
        # finish it a second time (printing to stdout after a --json document).
        with contextlib.redirect_stdout(sys.stderr):
            trackio.finish()
