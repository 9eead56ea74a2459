"""Pearson's chi-square tests without scipy: goodness of fit and two samples, with exact p-values.

p-value = Q(df / 2, stat / 2), the regularized upper incomplete gamma function, computed by its power
series below a + 1 and by its continued fraction (modified Lentz) above, to double precision.
"""

from __future__ import annotations

import math

import numpy as np


def chi2_sf(stat: float, df: int) -> float:
    a, x = df / 2.0, stat / 2.0
    if x <= 0:
        return 1.0
    log_prefix = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:  # P by its series, Q = 1 - P
        term = total = 1.0 / a
        n = a
        while abs(term) > 1e-16 * abs(total):
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_prefix))
    b, c, d = x + 1 - a, 1e300, 1.0 / (x + 1 - a)
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return h * math.exp(log_prefix)


def goodness_of_fit(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of observed counts against known probabilities; cells
    expected to hold fewer than min_expected samples are pooled into one."""
    counts = np.asarray(counts, np.float64).ravel()
    expected = np.asarray(probs, np.float64).ravel() * counts.sum()
    if counts[expected == 0].sum() > 0:
        return math.inf, 0, 0.0  # an impossible outcome happened
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return stat, df, chi2_sf(stat, df)


def two_sample(a: np.ndarray, b: np.ndarray, min_count: float = 10.0) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) that two count vectors come from one distribution; cells
    with fewer than min_count samples in both together are pooled into one."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    big = (a + b) >= min_count
    a = np.append(a[big], a[~big].sum())
    b = np.append(b[big], b[~big].sum())
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    na, nb = a.sum(), b.sum()
    exp_a = (a + b) * na / (na + nb)
    exp_b = (a + b) * nb / (na + nb)
    stat = float(((a - exp_a) ** 2 / exp_a + (b - exp_b) ** 2 / exp_b).sum())
    df = len(a) - 1
    return stat, df, chi2_sf(stat, df)
