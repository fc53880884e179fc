"""RUN/run.json: what a training run was (its resolved options, target, cache, plan, drafter shape,
the paths its kernels and loss took). `pipeline train` writes it at every start and resume; eval
reads the target it recorded, report reads the plan's length."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.files import write_json_atomic
from pipeline.records.run_dir import RunDir
from pipeline.records.typed import dump_record


@dataclass(frozen=True)
class RunRecord:
    target: str                             # the target directory the run resolved
    config: dict                            # the resolved TrainConfig (dataclasses.asdict)
    plan: dict                              # the resolved plan: total_steps, warmup_steps, batch sizes
    drafter: dict                           # the DrafterConfig the run built
    target_config_sha256: str | None = None
    target_weights: dict | None = None      # the weights whose predictions the drafter learns (from the cache)
    cache: str | None = None                # where the cache was: a path or a bucket URL
    world_size: int | None = None
    device: str | None = None
    autocast: str | None = None
    frozen_dtype: str | None = None
    loss_path: str | None = None
    slot_weights: str | None = None         # what weighed the draft slots, and what it left unused (gamma under dpace)
    attention_path: str | None = None
    draft_vocab: dict | None = None         # a draft vocabulary's size, digest, coverage, reserved tokens (DESIGN 3.4)
    tap_projection: dict | None = None      # a projected cache's basis: rank, digest, energy, pilot tokens (pipeline/projection)
    optimizer: str | None = None
    kernels: list | None = None             # the kernel paths the cache was extracted with
    incomplete_cache: dict | None = None    # what was missing when the run started on an incomplete cache
    resumed_from_step: int = 0

    @property
    def total_steps(self) -> int:
        return int(self.plan["total_steps"])


def write_run_record(run_dir: Path, record: RunRecord) -> Path:
    path = RunDir(run_dir).run_record
    write_json_atomic(path, dump_record(record))
    return path


def read_run_record(path: Path) -> RunRecord:
    """RUN/run.json (or the file itself) as a RunRecord; one-line PipelineError naming the file and
    what is wrong. Fields a newer pipeline added are optional, so older runs still read."""
    path = Path(path)
    if path.is_dir():
        path = RunDir(path).run_record
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise PipelineError(f"{path}: cannot read the run record ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PipelineError(f"{path}: not a training run record (invalid JSON: {e})") from None
    if not isinstance(raw, dict):
        raise PipelineError(f"{path}: not a training run record (not a JSON object)")
    fields = {f.name: f for f in dataclasses.fields(RunRecord)}
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
    missing = [n for n in required if n not in raw]
    if missing:
        raise PipelineError(f"{path}: not a training run record (no {', '.join(repr(n) for n in missing)})")
    if not isinstance(raw["target"], str) or not isinstance(raw["plan"], dict):
        raise PipelineError(f"{path}: not a training run record ('target' must be a path, 'plan' an object)")
    return RunRecord(**{k: v for k, v in raw.items() if k in fields})
