"""The distribution test for speculative sampling (issue 42): samples of the first L generated
tokens against the target's exact distribution over them, by Pearson's chi-square.

The exact distribution is computed by plain forwards of the target (no decoder code): every
continuation of L tokens whose probability is at least `floor` is enumerated breadth-first,
expanding only prefixes at or above it. Each such continuation whose expected count is >= 5 is a
category; all other continuations are pooled in one more ("other"). The power against a planted
fault is simulated from that fault's exact distribution over the same categories.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch


@torch.no_grad()
def exact_continuations(model, prompt: list[int], warp, length: int, floor: float) -> dict[tuple[int, ...], float]:
    """{continuation: probability} for every continuation of `length` tokens with probability >=
    floor, each token drawn from warp(the target's logits) given the prompt and the tokens before."""
    frontier = {(): 1.0}
    for _ in range(length):
        prefixes = list(frontier)
        ids = torch.tensor([prompt + list(x) for x in prefixes])
        probs = warp(model(input_ids=ids).logits[:, -1].float()).double()
        grown = {}
        for prefix, row in zip(prefixes, probs):
            for token in (row * frontier[prefix] >= floor).nonzero()[:, 0].tolist():
                grown[prefix + (token,)] = frontier[prefix] * float(row[token])
        frontier = grown
    return frontier


def categories(exact: dict[tuple[int, ...], float], samples: int) -> list[tuple[int, ...]]:
    """The continuations expected at least 5 times in `samples` draws (the chi-square's rule of thumb)."""
    return sorted(c for c, p in exact.items() if p * samples >= 5)


def chi_square(observed: Counter, exact: dict, cats: list) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of the observed continuations against `exact` over
    `cats` plus "other"."""
    n = sum(observed.values())
    expected = np.array([exact[c] * n for c in cats] + [n * (1 - sum(exact[c] for c in cats))])
    counts = np.array([observed.get(c, 0) for c in cats] + [n - sum(observed.get(c, 0) for c in cats)])
    keep = expected > 0
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    return stat, df, chi_square_sf(stat, df)


def chi_square_sf(x: float, df: int) -> float:
    """P(chi-square with df degrees of freedom > x): the regularised upper incomplete gamma."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)))


def critical_value(df: int, alpha: float) -> float:
    lo, hi = 0.0, 10.0 * df + 100
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi_square_sf(mid, df) > alpha else (lo, mid)
    return hi


def simulated_power(fault: dict, exact: dict, cats: list, samples: int, alpha: float, trials: int = 2000,
                    seed: int = 0) -> float:
    """The share of `trials` samples of size `samples` from the fault's distribution (over
    continuations; mass outside `fault`'s keys goes to "other") that the test rejects at alpha."""
    rng = np.random.default_rng(seed)
    faulty = np.array([fault.get(c, 0.0) for c in cats] + [max(0.0, 1 - sum(fault.get(c, 0.0) for c in cats))])
    faulty /= faulty.sum()
    expected = np.array([exact[c] for c in cats] + [1 - sum(exact[c] for c in cats)]) * samples
    keep = expected > 0
    counts = rng.multinomial(samples, faulty, size=trials)
    stats = (((counts - expected) ** 2)[:, keep] / expected[keep]).sum(axis=1)
    return float((stats > critical_value(int(keep.sum()) - 1, alpha)).mean())
