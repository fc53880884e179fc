"""Option blocks several commands share, declared once: a command's options dataclass inherits the
blocks it takes (`class EvalOptions(Device, Seeded, JsonOutput)`), so `--device` is one type, default
and parser everywhere. The help here is what the option means in any command; a command where it
means more (what --seed draws, which shards --shards writes) words that in its class's `OWN_HELP`
(pipeline/ui/options.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import option


@dataclass(kw_only=True)
class JsonOutput:
    json_out: bool = option(False, flag="--json", help="Print one JSON document on stdout instead of tables.")


@dataclass(kw_only=True)
class Device:
    device: str = option("auto", help="'auto' (the GPU when there is one), 'cpu', 'cuda' or 'cuda:N'.")
    dtype: str = option("auto", help="Model dtype: 'auto' (bfloat16 on a GPU, float32 on the CPU), 'float32' or 'bfloat16'.")


@dataclass(kw_only=True)
class Seeded:
    seed: int = option(0, help="Seed of the command's random choices: the same seed, the same result.")


@dataclass(kw_only=True)
class ShardSelection:
    shards: str | None = option(None, help="Only these shards, e.g. '0-63' or '3,5,8-11' (default: all).")


def config_file(given: Path | None, default_name: str) -> Path | None:
    """The TOML file a command reads: --config as given, else ./NAME where the working directory
    has one (extract.toml, train.toml), else none."""
    if given is not None or not Path(default_name).is_file():
        return given
    return Path(default_name)
