"""The RL fault matrix's per-run analysis: reward collapse, first alerts, curve maths, R3 verdicts, markdown tables."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np

from mindspeed_proxy.experiments.rl_matrix import read_jsonl

ROUTING = "routing-mismatch"


def collapse_step(rewards: dict[int, float], onset: Optional[int], window: int, factor: float) -> Optional[int]:
    """First step (the window's last) whose `window`-step mean reward is below `factor` × the mean before `onset`
    (the first `onset - 1` steps, or all steps of a healthy run's first third); a non-finite reward collapses."""
    steps = sorted(rewards)
    if not steps:
        return None
    cut = onset if onset is not None else steps[0] + max(len(steps) // 3, window)
    before = [rewards[s] for s in steps if s < cut]
    baseline = sum(before) / len(before) if before else 0.0
    for i, step in enumerate(steps):
        if step < cut:
            continue
        if not math.isfinite(rewards[step]):
            return step
        if i + 1 >= window:
            mean = sum(rewards[s] for s in steps[i + 1 - window:i + 1]) / window
            if baseline > 0 and mean < factor * baseline:
                return step
    return None


def moving_average(values: list[float], width: int) -> list[float]:
    """Trailing moving averages (the first width-1 points average what there is)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i + 1 - width):i + 1]
        out.append(sum(part) / len(part))
    return out


def pearson(a: list[float], b: list[float]) -> Optional[float]:
    """Pearson correlation of two series (their common length, scipy.stats.pearsonr); None when one is constant."""
    n = min(len(a), len(b))
    if n < 2:
        return None
    x, y = np.asarray(a[:n], dtype=np.float64), np.asarray(b[:n], dtype=np.float64)
    if np.all(x == x[0]) or np.all(y == y[0]):
        return None
    from scipy.stats import pearsonr

    return float(pearsonr(x, y)[0])


def run_data(run_dir, onset: Optional[int], collapse: dict, alerts: Optional[list] = None,
             stopped: bool = False) -> dict:
    """Reward curve, collapse step and alerts of one run directory (`alerts`: replayed ones instead of the
    run's online alerts); `stopped`: the run ended early (the trainer's non-finite check), at the step recorded."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    steps = [r for r in read_jsonl(metrics) if r.get("type") == "step"] if metrics.is_file() else []
    monitor = run_dir / "mechanism_monitor" / "monitor.jsonl"
    if alerts is None:
        alerts = [r for r in read_jsonl(monitor) if r.get("type") == "alert"] if monitor.is_file() else []
    rewards = {r["iteration"]: r["reward_mean"] for r in steps}
    after = [a for a in alerts if onset is None or a["step"] >= onset]
    first = min(after, key=lambda a: a["step"]) if after else None
    families = {}
    for a in sorted(after, key=lambda a: a["step"]):
        families.setdefault(a["family"], a["step"])
    return {"rewards": rewards, "collapse": collapse_step(rewards, onset, **collapse), "alert_list": alerts,
            "stopped": max(rewards, default=0) + 1 if stopped else None,
            "onset": onset, "alerts": len(alerts), "early_alerts": len(alerts) - len(after), "first": first,
            "families": families,
            "routing_alerts": sum(a["mechanism"].startswith(ROUTING) for a in after),
            "topk_match_min": min((r["topk_match_mean"] for r in steps if "topk_match_mean" in r), default=None),
            "gap_steps": [r for r in steps if "gap_abs_mean" in r and (onset is None or r["iteration"] >= onset)]}


def _label(alert: Optional[dict]) -> str:
    if alert is None:
        return "none"
    where = "" if alert["layer"] is None else f" L{alert['layer']}"
    return f"{alert['step']} {alert['family']}/{alert['metric']}{where} ({alert['mechanism'].split(':')[0]})"


def r3_verdicts(cfg: dict, data: dict) -> list[dict]:
    """For each R3 control: routing-mismatch alerts without R3 and with it (must be 0)."""
    rows = []
    for fault in cfg["r3_controls"]:
        for model in ("original", "proxy"):
            off, on = data.get(f"{model}_{fault}"), data.get(f"{model}_{fault}_r3")
            if off is None or on is None:
                continue
            rows.append({"fault": fault, "model": model, "without_r3": off["routing_alerts"],
                         "with_r3": on["routing_alerts"],
                         "verdict": "met" if off["routing_alerts"] > 0 and on["routing_alerts"] == 0 else "MISS"})
    return rows


def gap_rows(cfg: dict, data: dict) -> list[dict]:
    """Train–rollout gap decomposition per run (steps from the onset with a decomposition): means and the cause."""
    rows = []
    for name, d in data.items():
        steps = d.get("gap_steps") or []
        if not steps:
            continue
        mean = {k: sum(r[k] for r in steps) / len(steps) for k in ("gap_abs_mean", "gap_flip_share",
                                                                   "gap_weights_share", "gap_other_share",
                                                                   "gap_flipped_token_frac")}
        causes = [r["gap_cause"] for r in steps]
        rows.append({"run": name, "steps": len(steps), **mean,
                     "dominant_cause": max(set(causes), key=causes.count)})
    return rows


def _table(rows: list[dict]) -> str:
    if not rows:
        return "(no runs)\n"

    def cell(v):
        return f"{v:.3f}" if isinstance(v, float) else "–" if v is None else str(v)
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    lines += ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"
