"""The RL fault matrix's analysis: reward collapse, first alerts, E1–E4 and cost tables, the results page."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

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
    """Pearson correlation of two series (their common length); None when one is constant."""
    n = min(len(a), len(b))
    if n < 2:
        return None
    a, b = a[:n], b[:n]
    ma, mb = sum(a) / n, sum(b) / n
    va = math.sqrt(sum((x - ma) ** 2 for x in a))
    vb = math.sqrt(sum((y - mb) ** 2 for y in b))
    if not va or not vb:
        return None
    return sum((x - ma) * (y - mb) for x, y in zip(a, b)) / (va * vb)


def run_data(run_dir, onset: Optional[int], collapse: dict) -> dict:
    """Reward curve, collapse step and alerts of one run directory."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    steps = [r for r in read_jsonl(metrics) if r.get("type") == "step"] if metrics.is_file() else []
    monitor = run_dir / "mechanism_monitor" / "monitor.jsonl"
    alerts = [r for r in read_jsonl(monitor) if r.get("type") == "alert"] if monitor.is_file() else []
    rewards = {r["iteration"]: r["reward_mean"] for r in steps}
    after = [a for a in alerts if onset is None or a["step"] >= onset]
    first = min(after, key=lambda a: a["step"]) if after else None
    families = {}
    for a in sorted(after, key=lambda a: a["step"]):
        families.setdefault(a["family"], a["step"])
    return {"rewards": rewards, "collapse": collapse_step(rewards, onset, **collapse), "alert_list": alerts,
            "onset": onset, "alerts": len(alerts), "early_alerts": len(alerts) - len(after), "first": first,
            "families": families,
            "routing_alerts": sum(a["mechanism"].startswith(ROUTING) for a in after),
            "topk_match_min": min((r["topk_match_mean"] for r in steps), default=None),
            "gap_steps": [r for r in steps if "gap_abs_mean" in r and (onset is None or r["iteration"] >= onset)]}


def analyse(cfg: dict, results: list) -> dict:
    """Per-run data keyed by run name, from the matrix's results."""
    from mindspeed_proxy.experiments.matrix import fault_onset

    return {r.name: {**run_data(r.run_dir, fault_onset(r.spec), cfg["collapse"]), "result": r} for r in results}


def _label(alert: Optional[dict]) -> str:
    if alert is None:
        return "none"
    where = "" if alert["layer"] is None else f" L{alert['layer']}"
    return f"{alert['step']} {alert['family']}/{alert['metric']}{where} ({alert['mechanism'].split(':')[0]})"


def _restricted(d: dict, families) -> dict:
    """A run's alert summary counting only the alerts of `families` (None: all)."""
    if families is None:
        return d
    alerts = [a for a in d["alert_list"] if a["family"] in families]
    after = [a for a in alerts if d["onset"] is None or a["step"] >= d["onset"]]
    return {**d, "alerts": len(alerts), "early_alerts": len(alerts) - len(after),
            "first": min(after, key=lambda a: a["step"]) if after else None}


def e1_rows(cfg: dict, data: dict, families=None) -> list[dict]:
    """E1: first alert (of `families`, default all) vs reward collapse of every run (healthy ones: 0 alerts)."""
    rows = []
    for fault in cfg["faults"]:
        for model in ("original", "proxy"):
            d = data.get(f"{model}_{fault}")
            if d is None:
                continue
            d = _restricted(d, families)
            first, collapse = d["first"], d["collapse"]
            lead = collapse - first["step"] if first and collapse is not None else None
            if d["result"].returncode:
                verdict = f"run FAILED (exit {d['result'].returncode}) after {len(d['rewards'])} steps"
            elif fault == "none":
                verdict = "met" if d["alerts"] == 0 else f"MISS: {d['alerts']} alert(s) on the healthy run"
            elif collapse is None:
                verdict = "no collapse (lead n/a)"
            else:
                verdict = "met" if lead is not None and lead > 0 else "MISS"
            rows.append({"fault": fault, "model": model, "first_alert": _label(first), "collapse": collapse,
                         "lead": lead, "early_alerts": d["early_alerts"], "verdict": verdict})
    return rows


def e2_rows(cfg: dict, data: dict) -> list[dict]:
    """E2: the first alert step of each family per faulted run, and the R3 controls."""
    rows = []
    for fault in cfg["faults"]:
        for model in ("original", "proxy"):
            for suffix in ("", "_r3"):
                d = data.get(f"{model}_{fault}{suffix}")
                if d is None:
                    continue
                rows.append({"fault": fault + (" + R3" if suffix else ""), "model": model,
                             "families": ", ".join(f"{f} {s}" for f, s in d["families"].items()) or "none",
                             "routing_mismatch_alerts": d["routing_alerts"], "topk_match_min": d["topk_match_min"]})
    return rows


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


def e3_rows(cfg: dict, data: dict) -> list[dict]:
    """E3: proxy vs original per fault: outcome, first-alert family and step (±25%), reward Pearson ≥ 0.9."""
    rows = []
    for fault in cfg["faults"]:
        a, b = data.get(f"original_{fault}"), data.get(f"proxy_{fault}")
        if a is None or b is None:
            continue
        steps = sorted(set(a["rewards"]) & set(b["rewards"]))
        width = cfg["pearson_smoothing"]
        r = pearson(moving_average([a["rewards"][s] for s in steps], width),
                    moving_average([b["rewards"][s] for s in steps], width))
        fa, fb = a["first"], b["first"]
        same_outcome = (a["collapse"] is None) == (b["collapse"] is None)
        same_family = (fa is None and fb is None) or (fa is not None and fb is not None and fa["family"] == fb["family"])
        close = (fa is None and fb is None) or (fa is not None and fb is not None and
                                                abs(fb["step"] - fa["step"]) <= 0.25 * fa["step"])
        ok = same_outcome and same_family and close and r is not None and r >= 0.9
        rows.append({"fault": fault, "outcome": f"{a['collapse']} / {b['collapse']}", "same_outcome": same_outcome,
                     "first_alert": f"{_label(fa)} / {_label(fb)}", "same_family": same_family, "step_close": close,
                     "reward_pearson": r, "verdict": "met" if ok else "MISS"})
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


def cost_rows(cfg: dict, data: dict) -> list[dict]:
    """Ranks, CPU and wall seconds per GRPO step of the healthy original and proxy runs."""
    rows = []
    for model in ("original", "proxy"):
        d = data.get(f"{model}_none")
        if d is not None:
            res = d["result"]
            rows.append({"model": model, "ranks": res.ranks, "cpu_s_per_step": res.cpu_s / res.iters,
                         "wall_s_per_step": res.wall_s / res.iters})
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


def markdown(cfg: dict, data: dict, e4: Optional[dict], extra: dict) -> str:
    """The results page (docs/results/rl_fault_matrix.md)."""
    e4_rows = [{"model": k, "eval_reward_after_conversion": v["before"], "eval_reward_after_rl": v["after"]}
               for k, v in (e4 or {}).items()]
    cost = cost_rows(cfg, data)
    ratio = (cost[0]["cpu_s_per_step"] / cost[1]["cpu_s_per_step"]) if len(cost) == 2 else None
    parts = [
        "# RL fault matrix (GRPO): original vs proxy\n\n",
        f"Regenerate: `{extra['command']}` ({extra['wall_min']:.1f} min wall on {extra['cores']} cores; "
        f"settings: `examples/configs/rl_fault_matrix.yaml`). One SFT ({cfg['sft_iters']} steps) + GRPO warm-up "
        f"({cfg['warmup_rl_iters']} steps) of the original ({cfg['original']['num_experts']} experts, "
        f"EP={cfg['original']['expert_parallel']}, {cfg['original']['ranks']} ranks), converted to "
        f"{cfg['proxy']['num_experts']} experts at EP={cfg['proxy']['expert_parallel']} ({cfg['proxy']['ranks']} "
        f"rank); each run: {cfg['run_iters']} GRPO steps from it, faults from step {cfg['onset']}, monitor on "
        f"(`examples/configs/{cfg['monitor_config'] or 'MonitorConfig defaults'}`). Reward collapse: the "
        f"{cfg['collapse']['window']}-step mean reward below {cfg['collapse']['factor']} × its mean before the "
        "onset. Every miss is reported as a miss.\n\n",
        "".join(f"- {note}\n" for note in extra.get("notes", [])) + ("\n" if extra.get("notes") else ""),
        "## E1: first alert vs reward collapse\n\n", _table(e1_rows(cfg, data)),
        "\nThe same runs counting only the router and rl families (the families are independent detectors, so "
        "these are the alerts a monitor without the spectral families would have raised; this view was chosen "
        "after seeing the spectral families' false alerts on the healthy runs):\n\n",
        _table(e1_rows(cfg, data, families=("router", "rl"))),
        "\n## E2: which family names which fault (first alert step per family, from the onset)\n\n",
        _table(e2_rows(cfg, data)),
        "\nR3 control (routing replay of the rollout's routing): the routing-mismatch alerts must vanish.\n\n",
        _table(r3_verdicts(cfg, data)),
        "\n## E3: does the proxy reproduce the original?\n\n",
        f"Reward Pearson on {cfg['pearson_smoothing']}-step moving averages; first alert within ±25% of the "
        "original's step.\n\n", _table(e3_rows(cfg, data)),
        "\n## E4: the proxy's task reward (held-out, "
        f"{cfg['e4_eval_prompts']} prompts × 4 samples) right after conversion and after {cfg['run_iters']} "
        "GRPO steps\n\n", _table(e4_rows),
        *(["\n## Train–rollout gap decomposition (shares of Σ|term|; steps from the onset)\n\n",
           _table(gap_rows(cfg, data))] if gap_rows(cfg, data) else []),
        "\n## Cost (healthy runs)\n\n", _table(cost),
        f"\nProxy vs original: {cost[1]['ranks'] if len(cost) == 2 else '–'} vs "
        f"{cost[0]['ranks'] if cost else '–'} ranks, "
        f"{ratio:.2f}× less CPU per step.\n" if ratio else "\n",
    ]
    return "".join(parts)
