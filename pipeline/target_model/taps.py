"""Layer taps: which target decoder layers feed the drafter's context features (DESIGN 3.1).

Tap `i` is the output of decoder layer `i` (0-based), i.e. `hidden_states[i + 1]` of a
transformers forward with `output_hidden_states=True` (`hidden_states[0]` is the embedding
output). The last decoder layer is never a tap: transformers returns it after the final norm,
and it is the source of the target's own prediction.
"""

from __future__ import annotations

from presets import load_preset
from pipeline.config import EMBEDDED
from pipeline.errors import PipelineError

# Recorded with every cache and checkpoint so nobody has to guess the convention.
TAP_CONVENTION = "tap i = output of decoder layer i (0-based) = hidden_states[i + 1]"


def default_taps(num_layers: int, num_taps: int) -> list[int]:
    """Evenly spaced taps from layer 1 to layer num_layers - 3 (the DFlash reference rule).

    round(1 + k * (L - 4) / (n - 1)) for k = 0..n-1; one tap sits in the middle. For L=64, n=5
    this is [1, 16, 31, 46, 61]; for L=8, n=3 it is [1, 3, 5].
    """
    if num_taps < 1:
        raise PipelineError(f"num_taps must be at least 1, got {num_taps}")
    if num_taps == 1:
        return [num_layers // 2]
    span = num_layers - 4
    taps = [int(round(1 + k * span / (num_taps - 1))) for k in range(num_taps)]
    validate_taps(taps, num_layers)
    return taps


def validate_taps(taps: list[int], num_layers: int) -> None:
    """Refuse taps that are out of range, repeated, unordered or the last layer."""
    if not taps:
        raise PipelineError("target_layer_ids is empty")
    for t in taps:
        if not 0 <= t < num_layers:
            raise PipelineError(f"target_layer_ids: {t} is out of range for a {num_layers}-layer target (0..{num_layers - 1})")
        if t == num_layers - 1:
            raise PipelineError(
                f"target_layer_ids: {t} is the last decoder layer; transformers returns it after the final norm "
                "and it is the target's own prediction source, so it cannot be a tap")
    if sorted(set(taps)) != list(taps):
        raise PipelineError(f"target_layer_ids must be strictly increasing without repeats, got {list(taps)} "
                            f"(for {num_layers} layers try fewer taps)")


def hidden_state_indices(taps: list[int]) -> list[int]:
    """Indices into a transformers `hidden_states` tuple for these taps."""
    return [t + 1 for t in taps]


def taps_for(target: str, num_layers: int) -> list[int]:
    """The taps extract uses when --layers is not given: the tiny preset's for the embedded
    target, else five spread over the layers (`default_taps`)."""
    if target == EMBEDDED:
        return list(load_preset("tiny")["target"]["target_layer_ids"])
    return default_taps(num_layers, 5)
