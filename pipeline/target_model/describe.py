"""Describing a target for people: its layer pattern in a few words. The check that it is the model
the data came from is pipeline/data/self_agreement.py."""

from __future__ import annotations


def layer_pattern(layer_types: list[str]) -> str:
    """['linear_attention'] * 3 + ['full_attention'] -> 'linear x3, full'."""
    runs: list[list] = []
    for kind in layer_types:
        short = kind.removesuffix("_attention")
        if runs and runs[-1][0] == short:
            runs[-1][1] += 1
        else:
            runs.append([short, 1])
    return ", ".join(k if n == 1 else f"{k} x{n}" for k, n in runs)
