"""Detector thresholds from healthy runs: per-run maximum scores, an order-statistic (or Gumbel) quantile.

A detector form (frozen baseline or EMA, z-threshold or CUSUM) has one free parameter: `z_threshold`
for the threshold forms, `cusum_h` for the CUSUM forms. For a series, a healthy run's *score* is the
smallest value of that parameter at which the real `SeriesDetector` raises no alert of the form's kind
on the run; a statistic's score is the maximum over its series (layers). A run raises a false alarm on
the statistic iff the threshold is below its score, so the threshold is a quantile of the per-run
maximum scores, never of the per-sample ones.

With N exchangeable healthy runs and a new one, the k-th largest of the N tuning scores is exceeded by
the new run's score with probability ≤ k/(N+1) (exactly k/(N+1) for continuous scores), averaged over
tuning sets; k = ⌊q·(N+1)⌋ for a per-run budget q. When N+1 < 1/q no order statistic gives the budget
and a Gumbel law fitted to the N maxima (moments) is extrapolated instead: no distribution-free guarantee.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Optional, Sequence

from mindspeed_proxy.monitor.detectors import DetectorConfig, SeriesDetector

# form -> (fixed detector fields, the calibrated field, alert kind it controls)
FORMS: dict[str, tuple[dict, str, str]] = {
    "frozen": ({"method": "median_mad", "cusum": False}, "z_threshold", "threshold"),
    "ema": ({"method": "ema", "cusum": False}, "z_threshold", "threshold"),
    "cusum": ({"method": "median_mad", "cusum": True, "z_threshold": 1e9}, "cusum_h", "cusum"),
    "ema-cusum": ({"method": "ema", "cusum": True, "z_threshold": 1e9}, "cusum_h", "cusum"),
}
TAILS = ("auto", "order", "gumbel")
# what a threshold of 0 means, said where one is printed (`calibrate`, the RL matrix pages)
ZERO_THRESHOLD_MEANING = ("every tuning run scored 0 (never past its baseline in the alert direction), so any such move "
                          "of a new run alerts")
EULER_GAMMA = 0.5772156649015329


class CalibrationError(ValueError):
    """Calibration impossible with these runs and this rate (the message says why)."""


def form_config(base: DetectorConfig, form: str, value: Optional[float] = None) -> DetectorConfig:
    """`base` switched to detector form `form`, its calibrated field set to `value` when given."""
    fixed, field, _ = FORMS[form]
    overrides = dict(fixed)
    if value is not None:
        overrides[field] = float(value)
    return dataclasses.replace(base, **overrides)


def form_overrides(form: str, value: float) -> dict:
    """The config keys a calibrated statistic sets (`metric_detectors` entry)."""
    fixed, field, _ = FORMS[form]
    return {**fixed, field: float(value)}


def _alerts(values: Sequence[float], cfg: DetectorConfig, kind: str) -> bool:
    det = SeriesDetector(cfg)
    return any((a := det.update(i, v)) is not None and a["kind"] == kind for i, v in enumerate(values))


def _frozen_z(values: Sequence[float], cfg: DetectorConfig) -> list[float]:
    """z of every finite sample after the warm-up (a frozen baseline does not depend on the threshold)."""
    det = SeriesDetector(dataclasses.replace(cfg, z_threshold=math.inf, cusum=False))
    out = []
    for i, v in enumerate(values):
        if det.ready and math.isfinite(float(v)):
            out.append(det._z(float(v)))
        det.update(i, v)
    return out


def series_score(values: Sequence[float], base: DetectorConfig, form: str) -> float:
    """Smallest value of the form's parameter at which `values` raise no alert of its kind (≥ 0)."""
    cfg = form_config(base, form)
    _, field, kind = FORMS[form]
    if cfg.method == "median_mad":  # closed forms; the bisection below gives the same (tested)
        z = _frozen_z(values, cfg)
        if kind == "threshold":
            p = cfg.persistence
            windows = [min(z[i - p + 1:i + 1]) for i in range(p - 1, len(z))]
            return max([0.0] + windows)
        s, best = 0.0, 0.0
        for zi in z:
            s = max(0.0, s + zi - cfg.cusum_k)
            best = max(best, s)
        return best
    return bisect_score(values, cfg, field, kind)


def bisect_score(values: Sequence[float], cfg: DetectorConfig, field: str, kind: str,
                 rel_tol: float = 1e-7) -> float:
    """The score by bisection on the real detector (no alert of `kind` at the returned value)."""
    def quiet(x):
        return not _alerts(values, dataclasses.replace(cfg, **{field: x}), kind)

    if quiet(0.0):
        return 0.0
    hi = 1.0
    while not quiet(hi):
        hi *= 2.0
        if hi > 1e12:
            return math.inf
    lo = hi / 2.0 if hi > 1.0 else 0.0
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if quiet(mid) else (mid, hi)
    return hi


def statistic_score(series: Sequence[Sequence[float]], base: DetectorConfig, form: str) -> float:
    """A run's score on one statistic: the maximum over its series (layers)."""
    return max([0.0] + [series_score(s, base, form) for s in series])


def runs_needed(q: float) -> int:
    """The fewest tuning runs N whose order statistic meets a per-statistic budget q: ⌊q·(N+1)⌋ ≥ 1, i.e.
    N ≥ 1/q − 1 (with S statistics sharing a per-run budget q_total, q = q_total / S: N ≥ S/q_total − 1)."""
    if not q > 0:
        raise CalibrationError(f"per-run false-alarm budget {q} must be > 0")
    return max(1, math.ceil(1.0 / q - 1.0 - 1e-9))


def threshold_from_scores(scores: Sequence[float], q: float, tail: str = "auto") -> dict:
    """Threshold whose exceedance probability by a new run's score is ≤ q: {threshold, tail, k, promised}.

    order: the k-th largest of the N scores, k = ⌊q·(N+1)⌋ ≥ 1, promised k/(N+1) (distribution-free);
    gumbel: the (1 − q) quantile of a Gumbel law with the scores' mean and standard deviation (extrapolated);
    auto: order where k ≥ 1, else gumbel."""
    n = len(scores)
    if n == 0:
        raise CalibrationError("no healthy run scores")
    if not 0 < q:
        raise CalibrationError(f"per-run false-alarm budget {q} must be > 0")
    k = min(n, math.floor(q * (n + 1) + 1e-9))
    if tail == "order" or (tail == "auto" and k >= 1):
        if k < 1:
            need = runs_needed(q)
            raise CalibrationError(f"{n} healthy runs give no order-statistic threshold for a per-run false-alarm "
                                   f"budget of {q:.3g}: need ≥ {need} runs, or --tail gumbel")
        ranked = sorted(scores, reverse=True)
        return {"threshold": ranked[k - 1], "tail": "order", "k": k, "runs": n, "promised": k / (n + 1)}
    if n < 2:
        raise CalibrationError(f"a Gumbel fit needs ≥ 2 healthy runs, got {n}")
    finite = [s for s in scores if math.isfinite(s)]
    if len(finite) < n:
        raise CalibrationError("a run's score is infinite (its series alert at any threshold): no Gumbel fit")
    beta = statistics.stdev(finite) * math.sqrt(6.0) / math.pi
    if not beta > 0:
        raise CalibrationError(f"the {n} healthy runs' scores are all {finite[0]:.4g}: no spread to extrapolate "
                               f"a Gumbel tail from; need ≥ {runs_needed(q)} runs")
    mu = statistics.fmean(finite) - EULER_GAMMA * beta
    value = mu - beta * math.log(-math.log(1.0 - min(q, 1.0 - 1e-12)))
    return {"threshold": max(value, 0.0), "tail": "gumbel", "k": 0, "runs": n, "promised": q}


def calibrate_statistics(runs: Sequence[dict], bases: dict, form: str, q_total: float,
                         tail: str = "auto", skipped: Optional[dict] = None) -> dict:
    """Thresholds of every statistic: `runs` are {statistic: [series values...]} per healthy run, `bases`
    {statistic: DetectorConfig}; the per-run budget q_total is split equally (Bonferroni) over statistics.

    A statistic whose scores give no threshold raises CalibrationError, or, when `skipped` is a dict, is left
    out and recorded there ({statistic: reason}; its detector stays the base one); all of them left out raises.
    Returns {statistic: {threshold, tail, k, runs, promised, scores, overrides}}."""
    stats = sorted(bases)
    if not stats:
        raise CalibrationError("no tested statistic has healthy samples")
    q = q_total / len(stats)
    out = {}
    for stat in stats:
        scores = [statistic_score(run[stat], bases[stat], form) for run in runs if stat in run]
        try:
            result = threshold_from_scores(scores, q, tail)
        except CalibrationError as exc:
            if skipped is None:
                raise CalibrationError(f"{'/'.join(stat)} ({form}): {exc}") from None
            skipped["/".join(stat)] = str(exc)
            continue
        result["scores"] = scores
        result["overrides"] = form_overrides(form, result["threshold"])
        out[stat] = result
    if not out:
        first = next(iter(skipped.items()))
        raise CalibrationError(f"no statistic could be calibrated ({form}); {first[0]}: {first[1]}")
    return out
