"""Train's settings, resolved in one place for every command that needs them: `pipeline train`
itself, `demo`, and `cache-info --draft-vocab` (which must count the labels within the max_length
train will use, so it takes the same resolution rather than a copy of it).

The layers, later over earlier: TrainConfig's defaults < the preset (named, or the one whose
[target] matches the cache) < the TOML file's [train] tables < the flags given."""

from __future__ import annotations

from pathlib import Path

from presets import load_preset
from pipeline.config import TrainConfig
from pipeline.config.tables import build, file_tables, flag_tables, merge_tables, tables_of
from pipeline.errors import PipelineError
from pipeline.training.compat import match_preset


def resolve_config(path: Path | None, flags: dict, *, note=None) -> tuple[TrainConfig, dict | None]:
    """TrainConfig from defaults < preset < TOML [train] < flags; and the preset's [target] table.
    `note` hears of an old flat [train] table's keys (read into their components)."""
    from_file = file_tables(TrainConfig, path, section="train", note=note)
    from_flags = flag_tables(TrainConfig, flags)
    chosen = merge_tables(from_file, from_flags)
    name = chosen.get("job", {}).get("preset") or match_preset(chosen.get("data", {}).get("cache", "dflash-cache"))
    from_preset, preset_target = {}, None
    if name:
        preset, preset_target = preset_tables(name)
        from_preset = {**preset, "job": {**preset.get("job", {}), "preset": name}}
    cfg = build(TrainConfig, from_preset, from_file, from_flags, where=str(path or "options"))
    # D-PACE replaces the decay, so a gamma the user chose would be ignored: refused. A preset's
    # gamma is its decay recipe's, not a choice about this run; run.json says it is unused.
    if cfg.objective.position_weight == "dpace" and chosen.get("objective", {}).get("gamma") is not None:
        raise PipelineError(f"gamma: position_weight 'dpace' does not use gamma (its slot weights come from the "
                            f"drafter's own confidence); remove gamma from {path or 'the options'}, or use "
                            "--position-weight decay")
    return cfg, preset_target


def preset_tables(name: str) -> tuple[dict[str, dict], dict]:
    """(a preset's TrainConfig tables, its [target] table): the target's taps and mask token are
    the drafter's defaults."""
    preset = load_preset(name)
    target = preset.get("target", {})
    tables = tables_of(TrainConfig, {k: v for k, v in preset.items() if k != "target"}, where=f"preset {name}")
    tables["drafter"] = {**{k: v for k, v in target.items() if k in ("target_layer_ids", "mask_token")},
                         **tables["drafter"]}
    return tables, target


def max_length_source(train_config: Path | None, max_length: int | None, preset: str | None) -> str:
    """Which of resolve_config's layers (flag > TOML [train] > preset > default) set max_length."""
    if max_length is not None:
        return "--max-length"
    if "max_length" in file_tables(TrainConfig, train_config, section="train").get("data", {}):
        return str(train_config)
    if preset and "max_length" in preset_tables(preset)[0]["data"]:
        return f"preset {preset}"
    return "train's default"

