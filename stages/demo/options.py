"""`pipeline demo`'s options, each declared once: the field is the flag, its default and its help."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import option
from stages.options import JsonOutput


@dataclass(kw_only=True)
class DemoOptions(JsonOutput):
    out: Path = option(Path("dflash-demo"), help="Folder for everything the demo writes.")
    quick: bool = option(False, negatable=True, help="A one-minute version (fewer conversations, steps and prompts).")
    report_to: str | None = option(None, help="Experiment trackers for the training step (as `train --report-to`).")
    block_size: int | None = option(None, help="The drafter's block size (default: the tiny preset's 8; 16 is the flagship's and takes longer, BENCHMARKS.md).")
