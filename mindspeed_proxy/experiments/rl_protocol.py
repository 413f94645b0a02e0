"""The RL matrix's false-alarm protocol, checked before any run: the order-statistic condition of `calibrate` for
the planned tuning runs (no threshold extrapolated), the held-out healthy steps and seeds, and the planned cost."""
from __future__ import annotations

import math

from mindspeed_proxy.monitor.calibration import runs_needed

MODELS = ("original", "proxy")
MIN_HELDOUT_STEPS = 1000  # held-out healthy steps per model (issue 36)
MIN_HELDOUT_SEEDS = 3     # held-out seeds per fault


def healthy_counts(cfg: dict, seeds) -> int:
    """Healthy runs per model planned on `seeds`: one per seed, plus its `healthy_rl_seeds`."""
    return sum(1 + len(cfg["healthy_rl_seeds"].get(s, [])) for s in seeds)


def order_terms(n: int, statistics: int, rate: float, steps: int) -> dict:
    """`calibrate`'s budget for N tuning runs of `steps` steps, S statistics, R per 1000 steps: q, q/S, k,
    the promise per statistic k/(N+1) and in total S·k/(N+1) per run (and per 1000 steps), runs needed."""
    q = rate * steps / 1000.0
    per = q / statistics
    k = min(n, math.floor(per * (n + 1) + 1e-9))
    return {"runs": n, "statistics": statistics, "q": q, "q_per_statistic": per, "k": k,
            "promise_per_statistic": k / (n + 1), "promise_per_run": statistics * k / (n + 1),
            "promise_per_1000_steps": statistics * k / (n + 1) * 1000.0 / steps, "runs_needed": runs_needed(per)}


def protocol_check(cfg: dict, statistics: int) -> dict:
    """The protocol's figures per model and the list of its unmet conditions ([] when it holds)."""
    steps, rate = cfg["run_iters"], cfg["false_alarms_per_1000_steps"]
    n_tune = healthy_counts(cfg, cfg["tuning_seeds"])
    n_held = healthy_counts(cfg, cfg["heldout_seeds"])
    terms = order_terms(n_tune, statistics, rate, steps)
    unmet = []
    if terms["k"] < 1:
        unmet.append(f"{n_tune} tuning runs per model give no order statistic for S = {statistics} at R = {rate:g} "
                     f"and {steps}-step runs: need ≥ {terms['runs_needed']}")
    if n_held * steps < MIN_HELDOUT_STEPS:
        unmet.append(f"{n_held} held-out healthy runs × {steps} steps = {n_held * steps} < {MIN_HELDOUT_STEPS} "
                     "steps per model")
    if len(cfg["heldout_seeds"]) < MIN_HELDOUT_SEEDS:
        unmet.append(f"{len(cfg['heldout_seeds'])} held-out seeds per fault < {MIN_HELDOUT_SEEDS}")
    return {**terms, "tuning_runs_per_model": n_tune, "heldout_runs_per_model": n_held,
            "heldout_steps_per_model": n_held * steps, "unmet": unmet}


def planned_runs(cfg: dict) -> dict:
    """Number of processes the whole protocol runs: warm-ups (SFT + GRPO warm-up + conversion) and GRPO runs
    per model (healthy tuning, healthy held-out, faulted held-out incl. R3 controls)."""
    faulted = len([f for f in cfg["faults"] if f != "none"]) + len(cfg["r3_controls"])
    per_model = {m: healthy_counts(cfg, cfg["tuning_seeds"]) + healthy_counts(cfg, cfg["heldout_seeds"])
                 + faulted * len(cfg["heldout_seeds"]) for m in MODELS}
    return {"warmups": len(cfg["tuning_seeds"]) + len(cfg["heldout_seeds"]), "runs": per_model}


def planned_cpu_s(cfg: dict, cost: dict) -> float:
    """CPU seconds of the whole protocol from measured costs {warmup: s per SFT+warm-up+conversion,
    original: s per run, proxy: s per run} (E4 left out)."""
    plan = planned_runs(cfg)
    return plan["warmups"] * cost["warmup"] + sum(n * cost[m] for m, n in plan["runs"].items())


def tested_statistics(config) -> list[str]:
    """The statistics a MonitorConfig's detectors test, as `calibrate` names them (family/metric; update-spectral
    per tested slot): S of the budget split."""
    out = []
    for family, metrics in sorted(config.detect_metrics.items()):
        if family not in config.families:
            continue
        for m in metrics:
            out += [f"{family}/{slot}/{m}" for slot in config.detect_slots] if family == "update-spectral" \
                else [f"{family}/{m}"]
    return out
