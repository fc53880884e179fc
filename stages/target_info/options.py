"""`pipeline target-info`'s options, each declared once: the field is the flag, its default and its help."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import option
from stages.options import JsonOutput


@dataclass(kw_only=True)
class TargetInfoOptions(JsonOutput):
    path: Path | None = option(None, argument=True, help="Target model directory (default: the embedded tiny target).")
    data: Path | None = option(None, help="JSONL conversations the target generated, for a self-agreement check.")
