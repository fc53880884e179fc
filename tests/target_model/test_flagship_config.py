"""The flagship's config as the rehearsal target carries it (pipeline/toy/random_target.py):
Qwen3.6-27B's text config field by field, the preset's target facts agreeing with it, and
transformers reading it as the architecture the model card describes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from presets import load_preset
from pipeline.target_model import read_target_facts
from pipeline.target_model.taps import default_taps
from pipeline.toy.random_target import QWEN3_6_27B_TEXT_CONFIG, build_flagship_target, flagship_config
from harness.prerequisites import needs

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures"
TOKENIZER = FIXTURES / "tokenizers" / "qwen3.6"
TEMPLATE = FIXTURES / "chat_templates" / "qwen3.6.jinja"
needs_fixtures = needs(TOKENIZER.is_dir() and TEMPLATE.is_file(), f"the shared Qwen3.6 tokenizer and template are not at {FIXTURES}")


def test_the_preset_states_the_config_facts():
    preset = load_preset("qwen3.6-27b")["target"]
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        assert preset[key] == QWEN3_6_27B_TEXT_CONFIG[key], key
    assert preset["target_layer_ids"] == default_taps(QWEN3_6_27B_TEXT_CONFIG["num_hidden_layers"], 5)


def test_the_model_card_widths():
    """What the model card's overview states, read back through transformers' own config class."""
    from transformers import Qwen3_5TextConfig

    fields = {k: v for k, v in QWEN3_6_27B_TEXT_CONFIG.items() if k not in ("torch_dtype", "architectures")}
    config = Qwen3_5TextConfig(**fields)
    assert (config.hidden_size, config.vocab_size, config.num_hidden_layers, config.intermediate_size) == (5120, 248320, 64, 17408)
    assert config.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert config.layer_types.count("full_attention") == 16
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (24, 4, 256)
    assert (config.linear_num_value_heads, config.linear_num_key_heads) == (48, 16)
    assert config.linear_key_head_dim == config.linear_value_head_dim == 128
    assert int(config.head_dim * config.rope_parameters["partial_rotary_factor"]) == 64  # rotary dimension 64
    assert config.max_position_embeddings == 262144 and config.tie_word_embeddings is False


def test_fewer_layers_change_only_the_layer_fields():
    cut = flagship_config(8)
    assert {k for k in cut if cut[k] != QWEN3_6_27B_TEXT_CONFIG[k]} == {"num_hidden_layers", "layer_types"}
    assert cut["layer_types"] == QWEN3_6_27B_TEXT_CONFIG["layer_types"][:8]
    with pytest.raises(ValueError, match="multiple of 4"):
        flagship_config(6)


@needs_fixtures
def test_a_config_only_target_reads_as_the_flagship(tmp_path):
    target = build_flagship_target(tmp_path / "t", TOKENIZER, TEMPLATE, num_layers=8, weights=False)
    assert json.loads((target / "config.json").read_text()) == flagship_config(8)
    facts = read_target_facts(target)
    assert (facts.hidden_size, facts.vocab_size, facts.num_hidden_layers, facts.num_key_value_heads) == (5120, 248320, 8, 4)
    assert not list(target.glob("*.safetensors"))
