"""Statistics for train logs: windowed means with confidence intervals, window-vs-window
verdicts, cliffs, grad-norm anomalies, extrapolation. Plain Python (no SciPy).

Verdicts are statistical statements: the change between two windows against its standard
error (z = change / sqrt(se_a^2 + se_b^2)); |z| < 2 is a plateau, whatever one point says.
Entries are treated as independent noisy samples around a trend; a trend inside a window
inflates its spread, which makes the verdicts conservative.
"""

from __future__ import annotations

import math
import statistics

# Two-sided 95% Student t quantiles by degrees of freedom (1..30); 1.96 beyond.
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t95(df: int) -> float:
    return _T95[df - 1] if 1 <= df <= len(_T95) else 1.96


def window(values: list[float]) -> dict | None:
    """Mean, standard error and 95% confidence half-width of a window (None when empty)."""
    n = len(values)
    if n == 0:
        return None
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if n > 1 else 0.0
    se = sd / math.sqrt(n)
    return {"mean": mean, "se": se, "ci95": t95(n - 1) * se if n > 1 else None, "n": n}


def compare(before: dict, after: dict, direction: int) -> dict:
    """The change after - before, its z, and a verdict in the metric's better direction."""
    change = after["mean"] - before["mean"]
    se = math.sqrt(before["se"] ** 2 + after["se"] ** 2)
    z = change / se if se > 0 else (math.inf if change else 0.0) * (1 if change >= 0 else -1)
    if direction == 0:
        verdict = "changing" if abs(z) >= 2 else "steady"
    elif abs(z) < 2:
        verdict = "plateau"
    else:
        verdict = "improving" if z * direction > 0 else "regressing"
    return {"change": change, "z": z, "verdict": verdict}


def cliffs(steps: list[float], values: list[float], direction: int, *, before: int = 20, after: int = 3,
           threshold: float = 4.0, floor: float = 0.0) -> list[dict]:
    """Sudden moves in the bad direction: the mean of the next `after` entries is worse than the
    mean of the previous `before` by more than `threshold` times their spread (and by more than
    5% of the metric's scale and more than `floor`), so one noisy point is not a cliff."""
    found, i = [], before
    if direction == 0:
        return found
    while i + after <= len(values):
        pre, post = values[i - before:i], values[i:i + after]
        mean_pre = statistics.fmean(pre)
        spread = statistics.stdev(pre) if len(pre) > 1 else 0.0
        drop = (statistics.fmean(post) - mean_pre) * direction
        scale = max(abs(mean_pre), 1e-12)
        if drop < 0 and -drop > threshold * spread and -drop > 0.05 * scale and -drop > floor:
            # Place it at the sharpest single move inside the window that tripped the test.
            j = min(range(i, min(i + after, len(values))), key=lambda k: (values[k] - values[k - 1]) * direction)
            found.append({"step": steps[j], "before": statistics.fmean(values[max(0, j - before):j]),
                          "after": statistics.fmean(values[j:j + after])})
            i = j + before
        else:
            i += 1
    return found


def anomalies(steps: list[float], values: list[float], *, k: float = 10.0) -> list[dict]:
    """Entries far above the run's median (median + k * MAD), and non-finite ones."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return [{"step": s, "value": v} for s, v in zip(steps, values)]
    median = statistics.median(finite)
    mad = statistics.median([abs(v - median) for v in finite]) or max(abs(median) * 0.05, 1e-12)
    return [{"step": s, "value": v} for s, v in zip(steps, values) if not math.isfinite(v) or v > median + k * mad]


def extrapolate(steps: list[float], values: list[float], final_step: float) -> float | None:
    """Least squares of value on log(step) over the second half of the log, at `final_step`."""
    half = [(math.log(s), v) for s, v in zip(steps, values) if s > 0 and s >= steps[-1] / 2]
    if len(half) < 3:
        return None
    xs, ys = zip(*half)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return my
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my + slope * (math.log(final_step) - mx)
