"""Which target directory a command uses: the one place that decides (`resolve_target`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import EMBEDDED
from pipeline.embedded import TARGET_DIR
from pipeline.errors import PipelineError
from pipeline.target_model.facts import config_sha256, read_target_facts


@dataclass(frozen=True)
class RecordedTarget:
    """The target a cache or a training run recorded: where it was and which config it had."""
    path: str | None
    config_sha256: str | None
    source: str  # what recorded it, for messages ("the cache manifest", "RUN/run.json")


def recorded_in_cache(manifest) -> RecordedTarget:
    """The target a cache manifest (pipeline/cache/manifest.py) recorded: its directory and config digest."""
    return RecordedTarget(path=manifest.sources.target, config_sha256=manifest.identity.target.config_sha256,
                          source="the cache manifest")


def resolve_target(option: str | Path | None, recorded: RecordedTarget | None = None) -> Path:
    """The one place that decides which target directory a command uses:
    1. the option (--target DIR, or "embedded"), which must be a model directory;
    2. else the directory recorded by the cache or run, if its config.json is the recorded one;
    3. else, if the recorded directory is gone, the embedded target when it is the recorded model by
       config digest (a moved install).
    Never a different model: anything else is one error naming what was recorded."""
    if option:
        path = TARGET_DIR if str(option) == EMBEDDED else Path(option)
        read_target_facts(path)  # a clear error if it is not a model directory
        return path
    if recorded is None or (recorded.path is None and recorded.config_sha256 is None):
        raise PipelineError("no target given and none recorded: pass --target DIR")
    at_recorded = Path(recorded.path) if recorded.path else None
    found = config_sha256(at_recorded) if at_recorded else None
    if found is not None and recorded.config_sha256 in (None, found):
        return at_recorded
    if found is None and recorded.config_sha256 is not None and config_sha256(TARGET_DIR) == recorded.config_sha256:
        return TARGET_DIR
    state = "is not there" if found is None else "is not the recorded model (its config.json differs)"
    raise PipelineError(f"the target recorded in {recorded.source} ({recorded.path}) {state}; pass --target DIR")
