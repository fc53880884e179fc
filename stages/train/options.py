"""`pipeline train`'s own options; the training's settings are TrainConfig's option fields
(pipeline/config/train.py, by component), which a TOML file or a preset may also hold."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import option
from stages.options import JsonOutput


@dataclass(kw_only=True)
class TrainOptions(JsonOutput):
    config: Path | None = option(None, help="TOML config (\\[train] table), overridden by the options given here; default ./train.toml if present.")
    resume: bool = option(True, help="Resume from the last complete checkpoint in --out.")
