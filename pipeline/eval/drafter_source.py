"""A training run as eval finds it: the drafter export (RUN/ or RUN/drafter/) and what RUN/run.json
recorded about the target it was trained against."""

from __future__ import annotations

from pathlib import Path

from pipeline.drafter.export import ExportDir
from pipeline.errors import PipelineError
from pipeline.provenance import weight_digests
from pipeline.records.run import read_run_record
from pipeline.records.run_dir import RunDir
from pipeline.target_model import RecordedTarget, read_target_facts


def target_mismatch(target_dir: Path, run: Path) -> str | None:
    """How the eval target differs from the one the drafter's training run recorded (its config.json
    digest, and the weights the cache was extracted with), or None when it is the same or the run
    recorded neither. Large checkpoints are compared by their safetensors headers and sizes
    (pipeline.provenance.weight_digests), which tell other shapes apart but not other values."""
    try:
        record = read_run_record(run)
    except PipelineError:
        return None
    differs = []
    if record.target_config_sha256 and record.target_config_sha256 != read_target_facts(target_dir).config_sha256:
        differs.append("config.json")
    recorded = record.target_weights or {}
    if recorded.get("files"):
        found = weight_digests(target_dir)
        if found["method"] != recorded.get("method") or found["files"] != recorded["files"]:
            names = sorted(n for n in set(found["files"]) | set(recorded["files"])
                           if found["files"].get(n) != recorded["files"].get(n)) or ["weight files"]
            differs.append(f"weights ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''})")
    return " and ".join(differs) or None


def resolve_drafter(path: Path) -> tuple[Path, RecordedTarget | None]:
    """(drafter export dir, the target its training run recorded): accepts RUN/ or RUN/drafter/."""
    path = Path(path)
    if ExportDir(RunDir(path).drafter).config.is_file():
        path = RunDir(path).drafter
    config = ExportDir(path).config
    if not config.is_file():
        raise PipelineError(f"{path}: not a drafter export (no {config.name}); pass the run directory or its drafter/")
    run = RunDir.holding(path).run_record
    recorded = None
    if run.is_file():
        record = read_run_record(run)
        recorded = RecordedTarget(path=record.target, config_sha256=record.target_config_sha256, source=str(run))
    return path, recorded
