"""Presets (target facts + drafter recipe) as TOML files.

A preset is data, not code: `presets/NAME.toml` (this folder). Consumers read the taps from the
preset (and later from the cache manifest), never recompute them silently.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from pipeline.errors import PipelineError

PRESETS_DIR = Path(__file__).resolve().parent


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def load_preset(name: str) -> dict:
    path = PRESETS_DIR / f"{name}.toml"
    if not path.is_file():
        raise PipelineError(f"unknown preset {name!r}; available: {', '.join(preset_names())}")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise PipelineError(f"{path}: invalid TOML ({e})") from None
