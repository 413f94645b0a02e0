"""Exact 95% intervals for measured false-alarm rates: Clopper–Pearson for runs alarmed out of n runs, Garwood
for an alert count (Poisson), from scipy's beta and chi-square quantiles."""
from __future__ import annotations


def binomial_interval(x: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Clopper–Pearson interval of a proportion from x successes in n trials (each tail (1 − level)/2)."""
    from scipy import stats

    if n <= 0 or not 0 <= x <= n:
        raise ValueError(f"binomial_interval: need 0 ≤ x ≤ n and n > 0, got x={x}, n={n}")
    a = (1.0 - level) / 2.0
    lower = 0.0 if x == 0 else float(stats.beta.ppf(a, x, n - x + 1))
    upper = 1.0 if x == n else float(stats.beta.ppf(1.0 - a, x + 1, n - x))
    return lower, upper


def poisson_interval(count: int, level: float = 0.95) -> tuple[float, float]:
    """Garwood interval of a Poisson mean from one observed `count` (each tail (1 − level)/2)."""
    from scipy import stats

    if count < 0:
        raise ValueError(f"poisson_interval: count must be ≥ 0, got {count}")
    a = (1.0 - level) / 2.0
    lower = 0.0 if count == 0 else float(stats.chi2.ppf(a, 2 * count)) / 2.0
    return lower, float(stats.chi2.ppf(1.0 - a, 2 * count + 2)) / 2.0
