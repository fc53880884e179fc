"""Train's settings, resolved in one place for every command that needs them: `pipeline train`
itself, `demo`, and `cache-info --draft-vocab` (which must count the labels within the max_length
train will use, so it takes the same resolution rather than a copy of it)."""

from __future__ import annotations

from pathlib import Path

from presets import load_preset
from pipeline.config import TrainConfig, load_config, read_config_file
from pipeline.errors import PipelineError
from pipeline.training.compat import match_preset


def resolve_config(path: Path | None, overrides: dict) -> tuple[TrainConfig, dict | None]:
    """TrainConfig from defaults < preset < TOML `[train]` < CLI; and the preset's [target] table."""
    chosen = {**read_config_file(TrainConfig, path, section="train"), **{k: v for k, v in overrides.items() if v is not None}}
    name = chosen.get("preset") or match_preset(chosen.get("cache", TrainConfig.cache))
    base, preset_target = {}, None
    if name:
        preset = load_preset(name)
        preset_target = preset.get("target", {})
        base = {k: v for k, v in preset_target.items() if k in ("target_layer_ids", "mask_token")}
        base.update(preset.get("drafter", {}))
        base["preset"] = name
    cfg = load_config(TrainConfig, path, overrides, section="train", base=base)
    # D-PACE replaces the decay, so a gamma the user chose would be ignored: refused. A preset's
    # gamma is its decay recipe's, not a choice about this run; run.json says it is unused.
    if cfg.position_weight == "dpace" and chosen.get("gamma") is not None:
        raise PipelineError(f"gamma: position_weight 'dpace' does not use gamma (its slot weights come from the "
                            f"drafter's own confidence); remove gamma from {path or 'the options'}, or use "
                            "--position-weight decay")
    return cfg, preset_target


def max_length_source(train_config: Path | None, max_length: int | None, preset: str | None) -> str:
    """Which of resolve_config's layers (CLI > TOML [train] > preset > default) set max_length."""
    if max_length is not None:
        return "--max-length"
    if "max_length" in read_config_file(TrainConfig, train_config, section="train"):
        return str(train_config)
    if preset and "max_length" in load_preset(preset).get("drafter", {}):
        return f"preset {preset}"
    return "train's default"
