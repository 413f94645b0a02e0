"""`compare_runs`: consistency of two recorded runs (e.g. original vs proxy under the same fault)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from mindspeed_proxy.report.divergence import DivergenceRule, divergence_step
from mindspeed_proxy.report.runs import FAMILIES, Run, family_aggregate, headline_metric, load_run


@dataclass(frozen=True)
class Thresholds:
    """What `consistent` means: both diverge or neither, first alerts within ±alert_tolerance, loss Pearson ≥
    min_loss_pearson on the common steps before the first divergence (all common steps when neither diverges)."""

    min_loss_pearson: float = 0.95
    alert_tolerance: float = 0.25  # relative to the first run's first-alert step
    min_common_steps: int = 3


def correlations(x: list[float], y: list[float]) -> dict:
    """Pearson and Spearman (scipy.stats) of paired finite values; None when undefined."""
    from scipy import stats

    pairs = [(a, b) for a, b in zip(x, y) if math.isfinite(a) and math.isfinite(b)]
    out = {"n": len(pairs), "pearson": None, "spearman": None}
    if len(pairs) < 2:
        return out
    xs, ys = zip(*pairs)
    if len(set(xs)) < 2 or len(set(ys)) < 2:
        return out
    out["pearson"] = float(stats.pearsonr(xs, ys)[0])
    out["spearman"] = float(stats.spearmanr(xs, ys)[0])
    return out


def _common(sa, va, sb, vb) -> tuple[list[int], list[float], list[float]]:
    """The values of two step series on their common steps."""
    b = dict(zip(sb, vb))
    steps = [s for s in sa if s in b]
    a = dict(zip(sa, va))
    return steps, [a[s] for s in steps], [b[s] for s in steps]


def _side(run: Run, rule: DivergenceRule) -> dict:
    """Divergence and first alert of one run."""
    div, reason = divergence_step(run.steps, run.loss, run.grad_norm, rule)
    first = run.first_alert()
    return {"run_dir": str(run.path), "diverged": div is not None, "divergence_step": div,
            "divergence_reason": reason, "alerts": len(run.alerts),
            "first_alert_step": None if first is None else first["step"],
            "first_alert_family": None if first is None else first.get("family")}


def compare_runs(a, b, rule: DivergenceRule = DivergenceRule(), thresholds: Thresholds = Thresholds()) -> dict:
    """Compare two run directories (or loaded Runs); returns sides, correlations, verdict and thresholds."""
    ra = a if isinstance(a, Run) else load_run(a)
    rb = b if isinstance(b, Run) else load_run(b)
    sa, sb = _side(ra, rule), _side(rb, rule)
    steps, la, lb = _common(ra.steps, ra.loss, rb.steps, rb.loss)
    loss = {**correlations(la, lb), "common_steps": len(steps)}
    # after a divergence the two losses blow up differently: the verdict correlates the steps before it
    cut = min((s["divergence_step"] for s in (sa, sb) if s["diverged"]), default=None)
    pre = [i for i, s in enumerate(steps) if cut is None or s < cut]
    loss_pre = {**correlations([la[i] for i in pre], [lb[i] for i in pre]), "common_steps": len(pre), "before": cut}
    families = {}
    for fam in FAMILIES:
        if not (ra.samples.get(fam) and rb.samples.get(fam)):
            continue
        metric = headline_metric(ra, fam)
        fs, fa, fb = _common(*family_aggregate(ra, fam, metric), *family_aggregate(rb, fam, metric))
        families[fam] = {"metric": metric, **correlations(fa, fb)}
    reasons = []
    if sa["diverged"] != sb["diverged"]:
        reasons.append("one run diverged and the other did not")
    fa_, fb_ = sa["first_alert_step"], sb["first_alert_step"]
    if (fa_ is None) != (fb_ is None):
        reasons.append("one run alerted and the other did not")
    elif fa_ is not None and abs(fb_ - fa_) > thresholds.alert_tolerance * max(fa_, 1):
        reasons.append(f"first alerts {fa_} vs {fb_} differ by more than {thresholds.alert_tolerance:.0%}")
    if loss_pre["common_steps"] < thresholds.min_common_steps:
        reasons.append(f"only {loss_pre['common_steps']} common steps before divergence")
    elif loss_pre["pearson"] is None:
        reasons.append("loss Pearson undefined (a constant loss)")
    elif loss_pre["pearson"] < thresholds.min_loss_pearson:
        where = "" if cut is None else f" (steps before {cut})"
        reasons.append(f"loss Pearson {loss_pre['pearson']:.4g} < {thresholds.min_loss_pearson}{where}")
    return {"a": sa, "b": sb, "loss": loss, "loss_before_divergence": loss_pre, "families": families,
            "verdict": "consistent" if not reasons else "inconsistent", "reasons": reasons,
            "thresholds": asdict(thresholds), "divergence_rule": rule.as_dict()}


def _fmt(v) -> str:
    """A table cell."""
    if v is None:
        return "n/a"
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def format_table(result: dict, verdict: bool = True) -> str:
    """The comparison as a small plain-text table plus (unless `verdict` is False) the verdict line."""
    a, b = result["a"], result["b"]
    rows = [("", "A", "B"), ("run", a["run_dir"], b["run_dir"]),
            ("diverged", a["diverged"], b["diverged"]),
            ("divergence step", a["divergence_step"], b["divergence_step"]),
            ("first alert step", a["first_alert_step"], b["first_alert_step"]),
            ("first alert family", a["first_alert_family"], b["first_alert_family"]),
            ("alerts", a["alerts"], b["alerts"])]
    width = [max(len(_fmt(r[i])) for r in rows) for i in range(3)]
    lines = ["  ".join(_fmt(c).ljust(w) for c, w in zip(r, width)) for r in rows]
    loss = result["loss"]
    lines += ["", f"loss on {loss['common_steps']} common steps: Pearson {_fmt(loss['pearson'])}, "
              f"Spearman {_fmt(loss['spearman'])}"]
    pre = result["loss_before_divergence"]
    if pre["before"] is not None:
        lines.append(f"loss on the {pre['common_steps']} common steps before step {pre['before']} (first divergence): "
                     f"Pearson {_fmt(pre['pearson'])}, Spearman {_fmt(pre['spearman'])}")
    for fam, c in result["families"].items():
        lines.append(f"{fam} ({c['metric']}, {c['n']} samples): Pearson {_fmt(c['pearson'])}, "
                     f"Spearman {_fmt(c['spearman'])}")
    if not verdict:
        return "\n".join(lines)
    t = result["thresholds"]
    lines.append(f"verdict: {result['verdict']} (loss Pearson >= {t['min_loss_pearson']} before the first "
                 f"divergence, first alerts within "
                 f"±{t['alert_tolerance']:.0%}, same divergence outcome)")
    lines += [f"  - {r}" for r in result["reasons"]]
    return "\n".join(lines)
