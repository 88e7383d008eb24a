"""How sure an accuracy is: the 95% interval of a proportion of validation clips.

An accuracy measured on n validation clips is a proportion: its 95% interval is Wilson's score
interval (Wilson, 1927), which stays inside [0, 1] and is right for small n, unlike the normal
approximation. The tables, trials.csv, MLflow and the answer sentences (`tune.outputs.answer`) use it.
It is scipy's `binomtest(k, n).proportion_ci(method="wilson")` (tests/test_answer.py checks they
agree), written out because scipy is not a declared dependency and `scipy.stats` takes most of a
second to import in every process that formats an accuracy.
"""
from __future__ import annotations

import math
from statistics import NormalDist

Z_95 = NormalDist().inv_cdf(0.975)   # 1.95996...: a two-sided 95% interval


def wilson_interval(correct: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of `correct` successes in `n` trials: (low, high) in [0, 1].
    n = 0 gives (0, 1): nothing is known."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= correct <= n:
        raise ValueError(f"correct={correct} must be between 0 and n={n}")
    p = correct / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def accuracy_interval(acc: float, n: int) -> tuple[float, float]:
    """The 95% interval of an accuracy `acc` measured on `n` clips (it is round(acc * n) correct);
    (nan, nan) for a missing accuracy or no clips."""
    if not math.isfinite(acc) or n <= 0:
        return math.nan, math.nan
    return wilson_interval(min(n, max(0, round(acc * n))), n)


def half_width(acc: float, n: int) -> float:
    """Half the width of `accuracy_interval` (nan when none): how much a comparison can trust."""
    low, high = accuracy_interval(acc, n)
    return (high - low) / 2


def format_interval(low: float, high: float) -> str:
    """`[0.58, 0.87]`: a 95% interval as written everywhere (Wilson's is not symmetric about the
    accuracy, so it is never written as ±); "" when there is none."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return ""
    return f"[{low:.2f}, {high:.2f}]"


def format_accuracy(acc: float, n: int, digits: int = 3) -> str:
    """`0.750 [0.58, 0.87]` (the accuracy and its 95% interval), `0.750` when n is unknown (0),
    `-` when there is no accuracy."""
    if not math.isfinite(acc):
        return "-"
    interval = format_interval(*accuracy_interval(acc, n))
    return f"{acc:.{digits}f} {interval}" if interval else f"{acc:.{digits}f}"
