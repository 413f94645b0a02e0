"""Exact 95% intervals for measured false-alarm rates: Clopper–Pearson for runs alarmed out of n runs, Garwood
for an alert count (Poisson), both by bisection on the float64 distribution functions."""
from __future__ import annotations

import math


def binomial_cdf(x: int, n: int, p: float) -> float:
    """P(X ≤ x) for X ~ Binomial(n, p)."""
    if x < 0:
        return 0.0
    if x >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    return min(1.0, sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp
                                 + (n - i) * lq) for i in range(x + 1)))


def poisson_cdf(x: int, mu: float) -> float:
    """P(Y ≤ x) for Y ~ Poisson(mu)."""
    if x < 0:
        return 0.0
    if mu <= 0.0:
        return 1.0
    return min(1.0, sum(math.exp(i * math.log(mu) - mu - math.lgamma(i + 1)) for i in range(x + 1)))


def _solve(f, lo: float, hi: float, target: float) -> float:
    """x in [lo, hi] with the decreasing f(x) = target, by bisection to float64 resolution."""
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if f(mid) > target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def binomial_interval(x: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Clopper–Pearson interval of a proportion from x successes in n trials (each tail (1 − level)/2)."""
    if n <= 0 or not 0 <= x <= n:
        raise ValueError(f"binomial_interval: need 0 ≤ x ≤ n and n > 0, got x={x}, n={n}")
    a = (1.0 - level) / 2.0
    lower = 0.0 if x == 0 else 1.0 - _solve(lambda q: 1.0 - binomial_cdf(x - 1, n, 1.0 - q), 0.0, 1.0, a)
    upper = 1.0 if x == n else _solve(lambda p: binomial_cdf(x, n, p), 0.0, 1.0, a)
    return lower, upper


def poisson_interval(count: int, level: float = 0.95) -> tuple[float, float]:
    """Garwood interval of a Poisson mean from one observed `count` (each tail (1 − level)/2)."""
    if count < 0:
        raise ValueError(f"poisson_interval: count must be ≥ 0, got {count}")
    a = (1.0 - level) / 2.0
    hi = 10.0 + 10.0 * count
    upper = _solve(lambda mu: poisson_cdf(count, mu), 0.0, hi, a)
    lower = 0.0 if count == 0 else -_solve(lambda m: 1.0 - poisson_cdf(count - 1, -m), -hi, 0.0, a)
    return lower, upper
