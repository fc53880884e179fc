"""Experiment trackers for `pipeline train --report-to tensorboard,wandb,mlflow,trackio`.

Each tracker is an optional extra; one that is named but not installed is a one-line error naming
the extra before any training starts. Every tracker gets the same things: every key of each
train_log.jsonl line (DESIGN 4) as a scalar under `train/` at that line's step (`pos_acc` as one
scalar per slot, `train/pos_acc/slot_K`), the run's resolved config and cache identity as
parameters, a text event per live verdict, and the drafter export as an artifact where the tracker
keeps artifacts (MLflow, W&B, trackio). Only rank 0 reports. `pipeline eval --report-to` adds
eval's figures under `eval/` at the training's last step (report_eval).

Where each writes (all offline-capable; nothing needs a network unless the user asks for it):
- tensorboard: event files under RUN/tensorboard (`tensorboard --logdir RUN/tensorboard`).
- mlflow: $MLFLOW_TRACKING_URI if set, else a SQLite store at RUN/mlflow.db (artifacts in
  RUN/mlartifacts).
- wandb: $WANDB_MODE if set; else online when an API key is configured, offline (RUN/wandb,
  `wandb sync` later) when not.
- trackio: trackio's local store ($TRACKIO_DIR, else trackio's default), project "dflash".

This module chooses and feeds the trackers; backends.py holds one class per tracker, each through
its own library.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.config.train import TRACKER_NAMES
from pipeline.records.eval_result import EvalResult, flat
from pipeline.records.run_dir import RunDir

# Each tracker: its name (that of its optional extra too) -> its class in backends.py. A new tracker
# is a class there and a line here; the options' help texts list these names.
# Each tracker's backend class (pipeline/tracking/backends.py); the names are the config's (report_to).
TRACKERS = dict(zip(TRACKER_NAMES, ("TensorBoard", "WandB", "MLflow", "Trackio"), strict=True))
SCALAR_PREFIX = "train/"


def scalars(record: dict, prefix: str = SCALAR_PREFIX) -> dict[str, float]:
    """A train_log.jsonl line as tracker scalars: numbers under `train/KEY`, the per-slot accuracy
    list as `train/pos_acc/slot_K` (K = the slot, 1-based as DESIGN numbers slots), step left out
    (it is the x axis), non-finite numbers kept (trackers draw them as gaps or markers)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)):
            out[prefix + key] = float(value)
        elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
            for k, v in enumerate(value, 1):
                out[f"{prefix}{key}/slot_{k}"] = float(v)
    return out


def flat_params(params: dict, prefix: str = "") -> dict:
    """Nested config -> {'config.lr': 0.0006, 'cache.capture.target_layer_ids': '[1, 3, 5]', ...}:
    numbers, strings, booleans and None kept, lists and empty dicts as JSON text (trackers that
    store parameters as text get str() of each)."""
    out: dict = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, name + "."))
        elif value is None or isinstance(value, (str, int, float, bool)):
            out[name] = value
        else:
            out[name] = json.dumps(value, default=str)
    return out


class Trackers:
    """Every tracker the run reports to; a no-op when there are none (or on ranks other than 0).
    A tracker that fails mid-run (its service gone, its store locked) is one warning and is
    dropped: a days-long training run does not die for its dashboard."""

    def __init__(self, backends: list, warn=None):
        self.backends = backends
        self.warn = warn or (lambda *_: None)

    def __bool__(self) -> bool:
        return bool(self.backends)

    def _each(self, action: str, call) -> None:
        for backend in list(self.backends):
            try:
                call(backend)
            except Exception as e:  # noqa: BLE001 - any tracker library error
                self.backends.remove(backend)
                self.warn(f"{backend.name}: {action} failed ({type(e).__name__}: {str(e)[:200]}); "
                          "no more reports to it in this run (train_log.jsonl has everything)")

    def log(self, record: dict, prefix: str = SCALAR_PREFIX) -> None:
        values = scalars(record, prefix)
        self._each("logging", lambda b: b.log(int(record["step"]), values))

    def event(self, step: int, cause: str, message: str, figure: float | None) -> None:
        self._each("an event", lambda b: b.event(step, cause, message, figure))

    def artifact(self, path: Path) -> None:
        self._each("the drafter artifact", lambda b: b.artifact(Path(path)))

    def flush(self) -> None:
        """Write out what the trackers buffer. The trainer calls it before each checkpoint, so a
        run killed later and resumed from that checkpoint has every line up to it in the
        trackers' stores (W&B offline excepted: it has no flush; see backends.WandB)."""
        self._each("flushing", lambda b: b.flush())

    def close(self) -> None:
        self._each("closing", lambda b: b.close())

    def abandon(self) -> None:
        """Stop reporting without the closing writes: the run lost its directory to another run
        (pipeline/training/run_claim.py), where TensorBoard's and MLflow's own stores are. What was
        flushed before stays; the run is left as running in the trackers, and the run that took
        the directory over continues it."""
        self._each("abandoning", lambda b: b.abandon())
        self.backends = []


def tracker_class(name: str):
    from pipeline.tracking import backends

    return getattr(backends, TRACKERS[name])


def open_trackers(names: list[str], *, run_dir: Path, run_name: str, params: dict, start_step: int,
                  warn=None) -> Trackers:
    """Start (or, on resume, continue) each named tracker's run. Import errors become one line
    naming the extra; nothing is started unless every named tracker can start."""
    for name in names:
        tracker_class(name).check_installed()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ids_path = RunDir(run_dir).tracker_ids  # so a resumed run continues the same tracker runs
    try:
        ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        ids = {}
    flat = flat_params(params)
    started = []
    try:
        for name in names:
            started.append(tracker_class(name)(run_dir=run_dir, run_name=run_name, params=flat, start_step=start_step,
                                        previous_id=ids.get(name)))
    except Exception:
        for backend in started:
            backend.close()
        raise
    ids.update({b.name: b.run_id for b in started if b.run_id})
    if ids:
        ids_path.write_text(json.dumps(ids, indent=2) + "\n")
    return Trackers(started, warn)


def eval_figures(result: EvalResult) -> dict[str, float]:
    """`pipeline eval`'s headline figures as tracker scalars (logged under `eval/`); a sampled
    eval's under `sampled_...` names, so the two never share a curve."""
    sampled = "sampled_" if result.sampling else ""
    speedup = "speedup_vs_plain_sampling" if sampled else "speedup_vs_greedy"
    out = {}
    for v, figures in result.variants.items():  # each variant's tracked figures (pipeline/records/eval_result.py)
        for figure in v.kind.tracked:
            out.update(flat([(v, figures)], speedup if figure == "speedup" else figure, prefix=sampled))
    out["prompts"] = result.prompts
    teacher = result.teacher_forced
    if teacher:
        out.update(tau_walk=teacher["tau_walk"], tau_estimate=teacher["tau_estimate"])
    return out


def report_eval(names: list[str], *, run_dir: Path, result: EvalResult, warn=None) -> int:
    """Send an eval's figures to the training run's trackers (the same tracker runs, continued
    from RUN/trackers.json), at the training's last logged step; returns that step."""
    from pipeline.report.logs import read_run

    step = int(read_run(RunDir(run_dir).train_log).last_step)
    trackers = open_trackers(names, run_dir=Path(run_dir), run_name=Path(run_dir).resolve().name, params={},
                             start_step=step, warn=warn)
    try:
        trackers.log({"step": step, **eval_figures(result)}, prefix="eval/")
    finally:
        trackers.close()
    return step
