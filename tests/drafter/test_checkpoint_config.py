"""A checkpoint's drafter config.json on a projected cache (pipeline/drafter/export.py): R and how
fc' reads it are written as `projected_rank` and `projected_energy`; a checkpoint written before R
had one name says `tap_projection` and `tap_projection_energy`, and must read to the same
DrafterConfig, or resuming it would be refused as another drafter (pipeline/training/checkpoint.py
compares the two). The files are written by hand, as each version wrote them."""

from __future__ import annotations

import json

import pytest

from pipeline.drafter.config import DrafterConfig
from pipeline.drafter.export import read_config

R = 40


def checkpoint_config(**projection) -> dict:
    """config.json as the export writes it for a drafter of 3 taps of 32 values, trained on R of them."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "vocab_size": 64,
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "rope_theta": 10000.0, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": 4096, "layer_types": ["sliding_attention", "full_attention"],
        "use_sliding_window": True, "sliding_window": 5, "torch_dtype": "float32", "dtype": "float32",
        "block_size": 6, "num_target_layers": 8,
        "dflash_config": {"target_layer_ids": [1, 3, 5], "mask_token_id": 63, "block_size": 6},
        **projection,
    }


def read(tmp_path, name: str, config: dict) -> DrafterConfig:
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return read_config(tmp_path / name)


@pytest.mark.parametrize("energy", [True, False])
def test_a_checkpoint_with_the_older_keys_reads_as_one_with_todays(tmp_path, energy):
    today = read(tmp_path, "today", checkpoint_config(projected_rank=R, projected_energy=energy))
    before = read(tmp_path, "before", checkpoint_config(tap_projection=R, tap_projection_energy=energy))
    assert before == today
    assert (today.projected_rank, today.projected_energy) == (R, energy)


def test_a_drafter_on_the_full_taps_has_no_projection_under_either_name(tmp_path):
    config = read(tmp_path, "full", checkpoint_config())
    assert (config.projected_rank, config.projected_energy) == (None, False)
