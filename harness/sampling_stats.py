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


# ---- The calibrated test (issue 81) ---------------------------------------------------------
# Pearson's statistic again, its p-value read from the statistic's own distribution under the
# exact distribution (simulated) instead of the asymptotic chi-square: with categories of 5 to
# 20 expected counts the asymptotic test rejects a correct decoder about 1.5 times as often as
# alpha says (0.0015 at 0.001, simulated); calibrated, it rejects it at most alpha of the time.

def _cells(exact: dict, cats: list) -> np.ndarray:
    """The probabilities of `cats` and of "other" (everything else)."""
    return np.array([exact[c] for c in cats] + [max(0.0, 1 - sum(exact[c] for c in cats))])


def _statistics(counts: np.ndarray, expected: np.ndarray) -> np.ndarray:
    keep = expected > 0
    return (((counts - expected) ** 2)[..., keep] / expected[keep]).sum(axis=-1)


def null_statistics(exact: dict, cats: list, samples: int, trials: int = 100_000, seed: int = 0) -> np.ndarray:
    """Pearson's statistic of `trials` samples of size `samples` drawn from `exact` itself
    (sorted): the statistic's distribution when the decoder is right."""
    probs = _cells(exact, cats)
    counts = np.random.default_rng(seed).multinomial(samples, probs / probs.sum(), size=trials)
    return np.sort(_statistics(counts, probs * samples))


def calibrated_p_value(statistic: float | np.ndarray, null: np.ndarray):
    """P(a correct decoder's statistic >= `statistic`) from `null` (a Monte Carlo p-value: (1 +
    the null statistics at or above it) / (1 + their number), never 0, valid at every size)."""
    above = len(null) - np.searchsorted(null, statistic, side="left")
    return (1 + above) / (1 + len(null))


def calibrated_chi_square(observed: Counter, exact: dict, cats: list, null: np.ndarray) -> tuple[float, float]:
    """(statistic, calibrated p-value) of the observed continuations against `exact` over `cats`
    plus "other"; `null` from `null_statistics` at the observed sample size."""
    n = sum(observed.values())
    counts = np.array([observed.get(c, 0) for c in cats] + [n - sum(observed.get(c, 0) for c in cats)])
    statistic = float(_statistics(counts, _cells(exact, cats) * n))
    return statistic, float(calibrated_p_value(statistic, null))


def calibrated_power(fault: dict, exact: dict, cats: list, samples: int, alpha: float, null: np.ndarray,
                     trials: int = 4000, seed: int = 0) -> float:
    """The share of `trials` samples of size `samples` drawn from `fault` (mass outside its keys
    goes to "other") whose calibrated p-value is below alpha. With `fault` = `exact` and another
    seed than the null's: the test's false-positive rate."""
    faulty = np.array([fault.get(c, 0.0) for c in cats] + [max(0.0, 1 - sum(fault.get(c, 0.0) for c in cats))])
    counts = np.random.default_rng(seed).multinomial(samples, faulty / faulty.sum(), size=trials)
    statistics = _statistics(counts, _cells(exact, cats) * samples)
    return float((calibrated_p_value(statistics, null) < alpha).mean())
