import pytest

from presets import load_preset, preset_names
from pipeline.errors import PipelineError
from pipeline.target_model.taps import default_taps, hidden_state_indices, validate_taps


def test_default_taps_match_design():
    assert default_taps(64, 5) == [1, 16, 31, 46, 61]
    assert default_taps(8, 3) == [1, 3, 5]
    assert default_taps(36, 5) == [1, 9, 17, 25, 33]
    assert default_taps(32, 1) == [16]


def test_taps_index_hidden_states_plus_one():
    assert hidden_state_indices([1, 3, 5]) == [2, 4, 6]


@pytest.mark.parametrize("taps, message", [
    ([1, 7], "last decoder layer"),
    ([1, 8], "out of range"),
    ([-1, 3], "out of range"),
    ([3, 1], "strictly increasing"),
    ([3, 3], "strictly increasing"),
    ([], "empty"),
])
def test_bad_taps_are_refused(taps, message):
    with pytest.raises(PipelineError, match=message):
        validate_taps(taps, 8)


def test_formula_degenerates_below_six_layers():
    with pytest.raises(PipelineError):
        default_taps(4, 3)


@pytest.mark.parametrize("name", preset_names())
def test_presets_use_the_default_taps(name):
    target = load_preset(name)["target"]
    assert target["target_layer_ids"] == default_taps(target["num_hidden_layers"], len(target["target_layer_ids"]))


def test_tiny_preset_matches_the_shipped_target(embedded):
    from pipeline.target_model import read_target_facts
    facts = read_target_facts(embedded.TARGET_DIR)
    target = load_preset("tiny")["target"]
    assert (facts.num_hidden_layers, facts.hidden_size, facts.vocab_size) == (
        target["num_hidden_layers"], target["hidden_size"], target["vocab_size"])


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(PipelineError, match="unknown preset 'nope'"):
        load_preset("nope")
