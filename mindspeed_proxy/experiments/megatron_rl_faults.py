"""Fault runs of Megatron-LM's `train_rl.py`: per run the first alert, the rollout-vs-train expert mismatch, the
reward (from the rollouts Megatron-LM pickles) and whether it collapses; the expectations and the markdown table.

A run directory holds `monitor/monitor.jsonl` (the mechanism monitor's output) and `langrl/` (Megatron-LM's
`LANGRL_LOG_DIR`: `rollouts_rank0_iteration{N}_*.pkl`, N = train_rl.py's 0-based `curr_iteration`, one list of
groups of rollouts each with a `.reward`). Steps here are train_rl.py's iterations (1-based), as in the monitor.
"""
from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mindspeed_proxy.experiments.rl_matrix import read_jsonl
from mindspeed_proxy.experiments.rl_tables import ROUTING, collapse_step

ROLLOUT_FILE = re.compile(r"rollouts_rank0_iteration(\d+)_.*\.pkl$")
COLLAPSE = {"window": 5, "factor": 0.5}  # collapsed: a 5-iteration mean reward below half the pre-onset mean


@dataclass(frozen=True)
class FaultRun:
    """One train_rl.py launch of the table: which model, which fault (an --inject-fault spec or None), R3 or not."""

    name: str
    model: str  # "original" or "proxy"
    fault: Optional[str] = None
    r3: bool = False

    @property
    def fault_name(self) -> Optional[str]:
        """The fault's name without its parameters."""
        return None if self.fault is None else self.fault.split(":", 1)[0]

    def expectation(self) -> str:
        """What the monitor should show: silence (healthy), a routing-mismatch alert (the rollout-side fault
        without R3), no routing mismatch at all (the rollout-side fault under R3), or any alert (trainer side)."""
        if self.fault is None:
            return "no alert"
        if self.fault_name == "rollout-router-noise":
            return "no mismatch (R3)" if self.r3 else "routing-mismatch alert"
        return "an alert"


def rollout_rewards(langrl_dir) -> dict[int, float]:
    """Iteration (1-based) -> mean reward of the rollouts rank 0 pickled for it (needs megatron.rl importable)."""
    out = {}
    for path in sorted(Path(langrl_dir).glob("rollouts_rank0_iteration*_*.pkl")):
        match = ROLLOUT_FILE.search(path.name)
        if match is None:
            continue
        groups = pickle.loads(path.read_bytes())
        rewards = [float(r.reward) for group in groups for r in group]
        if rewards:
            out[int(match.group(1)) + 1] = sum(rewards) / len(rewards)
    return out


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def alert_key(alert: dict) -> tuple:
    """What an alert is about: (family, metric, layer)."""
    return alert["family"], alert["metric"], alert.get("layer")


def summarize(monitor_jsonl, rewards: dict[int, float], onset: Optional[int], healthy: Optional[list] = None) -> dict:
    """One run's numbers: alerts (first, first routing-mismatch, before onset), the rl family's any-layer
    mismatch before / from the onset (mean and max), the reward before / at the end and its collapse step.
    `healthy`: the healthy run's alerts; from the onset, an alert about what one of them was about (same family,
    metric and layer) is not counted as the fault's (it is counted in `healthy_like`)."""
    records = read_jsonl(monitor_jsonl) if Path(monitor_jsonl).is_file() else []  # a run that failed early
    alerts = sorted((r for r in records if r.get("type") == "alert"), key=lambda a: a["step"])
    rl = [r for r in records if r.get("type") == "sample" and r.get("family") == "rl"]
    mismatch = {r["step"]: float(r["layers"]["all"]["any_layer_mismatch"]) for r in rl}
    repeats = [float(r["layers"]["all"]["duplicate_share"]) for r in rl if "duplicate_share" in r["layers"]["all"]]
    cut = onset if onset is not None else max(mismatch, default=0) + 1
    before = [v for s, v in mismatch.items() if s < cut]
    after = [v for s, v in mismatch.items() if s >= cut]
    steps = sorted(rewards)
    pre = [rewards[s] for s in steps if onset is None or s < onset]
    tail = [rewards[s] for s in steps[-COLLAPSE["window"]:]]
    late = [a for a in alerts if onset is None or a["step"] >= onset]
    seen = {alert_key(a) for a in healthy or []}
    healthy_like = [a for a in late if alert_key(a) in seen]
    late = [a for a in late if alert_key(a) not in seen]
    routing = [a for a in late if a["mechanism"].startswith(ROUTING)]
    return {"iterations": len(steps), "alerts": len(alerts), "healthy_like": len(healthy_like),
            "early_alerts": len(alerts) - len(late) - len(healthy_like) if onset is not None else len(alerts),
            "first": late[0] if late else None, "first_routing": routing[0] if routing else None,
            "routing_alerts": len(routing),
            "mismatch_before": _mean(before), "mismatch_after": _mean(after),
            "mismatch_after_max": max(after) if after else None,
            "reward_before": _mean(pre), "reward_end": _mean(tail), "duplicate_share": _mean(repeats),
            "collapse": collapse_step(rewards, onset, **COLLAPSE)}


def verdict(run: FaultRun, summary: dict) -> str:
    """"met", or "MISS: why" against the run's expectation (an alert before the onset, or a run that failed
    (summary["error"]: its first exception line), is a miss too)."""
    problems = []
    if summary.get("error"):
        problems.append(f"the run failed after {summary['iterations']} iterations: {summary['error']}")
    if run.fault is None:
        if summary["alerts"]:
            problems.append(f"{summary['alerts']} alert(s) on the healthy run")
    else:
        if summary["early_alerts"]:
            problems.append(f"{summary['early_alerts']} alert(s) before the onset")
        if run.fault_name == "rollout-router-noise" and not run.r3:
            if summary["first_routing"] is None:
                problems.append("no routing-mismatch alert")
            if not summary["mismatch_after"]:
                problems.append("no expert mismatch from the onset")
        elif run.fault_name == "rollout-router-noise":
            if summary["mismatch_after_max"] != 0.0:
                problems.append(f"expert mismatch {summary['mismatch_after_max']} under R3")
            if summary["routing_alerts"]:
                problems.append("routing-mismatch alert under R3")
        elif summary["first"] is None:
            problems.append("no alert from the onset" + (f" (only {summary['healthy_like']} like the healthy run's)"
                                                          if summary.get("healthy_like") else ""))
    return "met" if not problems else "MISS: " + "; ".join(problems)


def _alert_cell(alert: Optional[dict]) -> str:
    if alert is None:
        return "none"
    where = "" if alert.get("layer") is None else f" L{alert['layer']}"
    return f"{alert['step']}: {alert['family']}/{alert['metric']}{where} ({alert['mechanism'].split(':')[0]})"


def _step(alert: Optional[dict]) -> str:
    return "none" if alert is None else f"{alert['step']} ({alert['family']}/{alert['metric']})"


def _num(value: Optional[float], digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(rows: list[tuple[FaultRun, dict, dict]], onset: Optional[int]) -> str:
    """The markdown table: one line per (run, summary, extra) with extra's `ranks` and `wall_s`."""
    lines = [f"| run | model (ranks) | fault (onset {onset}) | R3 | first alert from the onset, unlike the healthy "
             "run's: step: family/metric (mechanism) | alerts like the healthy run's | first routing-mismatch alert "
             "| alerts before onset | any-layer mismatch before / from onset (max) | reward before onset / last 5 "
             "| reward collapses | repeated samples in a group (mean) | expected | verdict | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run, s, extra in rows:
        collapse = "no" if s["collapse"] is None else f"yes, at {s['collapse']}"
        lines.append(
            f"| {run.name} | {run.model} ({extra['ranks']}) | {run.fault or 'none'} | {'r3' if run.r3 else 'off'} | "
            f"{_alert_cell(s['first'])} | {s.get('healthy_like', 0)} | {_step(s['first_routing'])} | "
            f"{s['early_alerts']} | {_num(s['mismatch_before'], 4)} / {_num(s['mismatch_after'], 4)} "
            f"({_num(s['mismatch_after_max'], 4)}) | {_num(s['reward_before'])} / {_num(s['reward_end'])} | "
            f"{collapse} | {_num(s.get('duplicate_share'), 2)} | {run.expectation()} | {verdict(run, s)} | {extra['wall_s']:.0f} |")
    return "\n".join(lines)
