"""The RL fault matrix's results page (docs/results/rl_fault_matrix.md) from the held-out tables."""
from __future__ import annotations

from pathlib import Path

from mindspeed_proxy.experiments import rl_heldout as H
from mindspeed_proxy.experiments.rl_tables import _label, _table, gap_rows, r3_verdicts
from mindspeed_proxy.monitor.calibration import ZERO_THRESHOLD_MEANING


def run_rows(cfg: dict, data: dict, seeds) -> list[dict]:
    """Every held-out run: first alert (replayed), collapse, lead, exit code."""
    rows = []
    for s in seeds:
        for fault in cfg["faults"]:
            for model in H.MODELS:
                for suffix in ("", "_r3"):
                    d = data.get((s, f"{model}_{fault}{suffix}"))
                    if d is None:
                        continue
                    lead = H.lead_of(d)
                    rows.append({"seed": s, "fault": fault + (" + R3" if suffix else ""), "model": model,
                                 "first alert from onset": _label(d["first"]), "alerts before onset": d["early_alerts"],
                                 "collapse": d["collapse"], "lead": lead,
                                 "stopped at": d["stopped"],
                                 "families": ", ".join(f"{f} {t}" for f, t in d["families"].items()) or "none",
                                 "exit": d["result"].returncode})
    return rows


def cost_rows(results: list) -> list[dict]:
    """Wall and CPU seconds per stage kind, summed over every recorded stage, and per GRPO step for runs."""
    kinds: dict = {}
    for r in results:
        if r.cpu_s is None:  # a run kept from an earlier sitting whose cost was not recorded per run
            continue
        kind = r.name.split("_")[0] if r.name.startswith(("preprocess", "sft", "warmup", "convert", "e4")) \
            else f"run ({r.model})"
        k = kinds.setdefault(kind, {"stage": kind, "count": 0, "steps": 0, "wall_s": 0.0, "cpu_s": 0.0})
        k["count"] += 1
        k["steps"] += r.iters
        k["wall_s"] += r.wall_s
        k["cpu_s"] += r.cpu_s
    rows = sorted(kinds.values(), key=lambda k: k["stage"])
    for k in rows:
        k["wall_s_per_step"] = k["wall_s"] / k["steps"] if k["steps"] else None
    rows.append({"stage": "total", "count": sum(k["count"] for k in rows), "steps": sum(k["steps"] for k in rows),
                 "wall_s": sum(k["wall_s"] for k in rows), "cpu_s": sum(k["cpu_s"] for k in rows),
                 "wall_s_per_step": None})
    return rows


def calibration_text(name: str, cal: dict) -> str:
    """One calibration's summary line: thresholds with their tail and promise, the statistics left at the base
    config's detector, and the total promise per run."""
    if "error" in cal:
        return f"- **{name}** ({cal['runs']} runs): calibration FAILED: {cal['error']}\n"
    ths = ", ".join(f"{k} {v['threshold']:.3g} ({v['tail']}, promise {v['promised']:.3g})"
                    for k, v in cal["thresholds"].items()) or "none"
    total = sum(v["promised"] for v in cal["thresholds"].values())
    ths += f"; total promise {total:.3g} per run"
    unc = ", ".join(f"{k} ({'all scores equal' if 'no spread' in v else v})" for k, v in cal["uncalibrated"].items())
    return (f"- **{name}** ({cal['runs']} healthy tuning runs): {ths}" +
            (f". Left at the base config's detector (no threshold from these runs): {unc}" if unc else "") + "\n")


def zero_threshold_text(ctx: dict) -> str:
    """A note on the thresholds of 0 (every tuning run scored 0: the statistic never moved past its baseline in
    its alert direction), when there are any."""
    zero = sorted({k for cal in ctx["calibrations"].values() for k, v in cal.get("thresholds", {}).items()
                   if v["threshold"] == 0})
    if not zero:
        return ""
    return (f"A threshold of 0 ({', '.join(zero)}): {ZERO_THRESHOLD_MEANING} (the k-th largest score is 0). The "
            "bound k/(N + 1) still holds (ties only make it conservative), for held-out runs exchangeable with the "
            "tuning runs: it rests on the tuning runs moving as held-out runs do.\n\n")


def stage_costs(results: list) -> dict:
    """Mean recorded CPU seconds: per SFT + warm-up + conversion of a seed, per run of each model."""
    def mean(rs):
        rs = [r.cpu_s for r in rs if r.cpu_s is not None]
        return sum(rs) / len(rs) if rs else None

    kinds = {k: mean([r for r in results if r.name.startswith(k)])
             for k in ("preprocess", "sft", "warmup", "convert_cluster")}
    runs = {m: mean([r for r in results if r.name.startswith(f"{m}_") and r.iters]) for m in ("original", "proxy")}
    # our loop: SFT + GRPO warm-up + conversion; train_rl.py's: preprocess_data.py + pretrain_gpt.py + conversion
    needed = ("sft", "convert_cluster") + (("warmup",) if any(r.name == "warmup" for r in results) else ())
    warm = sum(v for v in kinds.values() if v is not None) if all(kinds[k] is not None for k in needed) else None
    return {"warmup": warm, **runs}


def protocol_text(cfg: dict, ctx: dict) -> str:
    """The false-alarm protocol: R, S, run length, N, held-out runs and seeds, the order-statistic condition and
    the planned CPU cost from the measured per-stage costs; every unmet condition named."""
    from mindspeed_proxy.experiments.rl_protocol import planned_cpu_s, planned_runs, protocol_check

    stats = ctx.get("tested_statistics") or []
    pc = protocol_check(cfg, len(stats))
    cost = stage_costs(ctx["results"])
    plan = planned_runs(cfg)
    extra = {int(k): v for k, v in cfg["healthy_rl_seeds"].items()}
    cpu = (f"{planned_cpu_s(cfg, cost) / 60:.0f} CPU min (measured here: {cost['warmup']:.0f} CPU s per SFT + "
           f"warm-up + conversion, {cost['original']:.0f} per original run, {cost['proxy']:.0f} per proxy run; "
           f"{planned_cpu_s(cfg, cost) / 120:.0f} min on 2 free cores)") if None not in cost.values() else \
        "not measured yet"
    return (
        "## Protocol (fixed before the runs)\n\n"
        f"- **Promise.** R = {cfg['false_alarms_per_1000_steps']:g} runs with a false alarm per 1000 steps, for "
        f"{cfg['run_iters']}-step runs: per-run budget q = R × {cfg['run_iters']} / 1000 = {pc['q']:.3g}, split over "
        f"S = {len(stats)} tested statistics ({', '.join(stats)}; base config "
        f"`examples/configs/{cfg.get('calibrate_config') or cfg['monitor_config']}`: the statistics whose first "
        f"alerts named faults in this matrix), q/S = {pc['q_per_statistic']:.3g}, form `{cfg['calibrate_form']}`.\n"
        f"- **Tuning.** N = {pc['tuning_runs_per_model']} healthy runs per model (≥ S/q − 1 = "
        f"{pc['runs_needed']}: order statistic k = {pc['k']}, promise k/(N + 1) = "
        f"{pc['promise_per_statistic']:.3g} per statistic, {pc['promise_per_run']:.3g} per run = "
        f"{pc['promise_per_1000_steps']:.3g} per 1000 steps; no Gumbel extrapolation): warm-up seeds "
        f"{cfg['tuning_seeds']}, one run each with the warm-up's seed, plus runs with RL seeds "
        f"{ {s: v for s, v in extra.items() if s in cfg['tuning_seeds']} } from those warm-ups.\n"
        f"- **Held-out.** {pc['heldout_runs_per_model']} healthy runs per model = {pc['heldout_steps_per_model']} "
        f"steps (≥ 1000): warm-up seeds {cfg['heldout_seeds']}, one each, plus RL seeds "
        f"{ {s: v for s, v in extra.items() if s in cfg['heldout_seeds']} }; every fault on the "
        f"{len(cfg['heldout_seeds'])} held-out warm-up seeds.\n"
        "- **Independence.** A warm-up seed sets `--seed` of SFT (initialisation, data), "
        + ("GRPO warm-up and " if cfg.get("warmup_rl_iters") else "and ") + "conversion; an RL seed sets `--seed` of "
        "one GRPO run (its prompts and sampling) from that warm-up. Tuning "
        "and held-out runs share no warm-up and no RL seed; runs from one warm-up share its weights, so they are "
        "exchangeable with each other but not independent draws of the warm-up (the order-statistic promise "
        "assumes a new run exchangeable with the tuning runs).\n"
        f"- **Cost.** {plan['warmups']} warm-ups, {plan['runs']['original']} original and {plan['runs']['proxy']} "
        f"proxy runs of {cfg['run_iters']} steps: {cpu}.\n"
        f"- **Conditions.** " + ("all met" if not pc["unmet"] else "UNMET: " + "; ".join(pc["unmet"])) + "\n"
        + recorded_text(cfg, ctx.get("stages") or {}) + "\n")


def recorded_text(cfg: dict, stages: dict) -> str:
    """'' when every planned run has a record, else a bullet naming how many of them do and which are missing."""
    from mindspeed_proxy.experiments.rl_matrix import planned_names

    planned = {s: planned_names(cfg, s, cfg["faults"]) for s in [*cfg["tuning_seeds"], *cfg["heldout_seeds"]]}
    missing = {s: [n for n in names if (s, n) not in stages] for s, names in planned.items()}
    absent, total = sum(map(len, missing.values())), sum(map(len, planned.values()))
    if not absent:
        return ""

    def names(seed):
        gone = missing[seed]
        return "all" if len(gone) == len(planned[seed]) else ", ".join(gone[:4]) + (", ..." if len(gone) > 4 else "")

    where = "; ".join(f"seed {s}: {len(v)} ({names(s)})" for s, v in missing.items() if v)
    return (f"- **Recorded so far: {total - absent} of {total} planned runs** (the tables below cover only these; "
            f"missing: {where}).\n")


def setup_text(cfg: dict) -> str:
    """The page's per-seed paragraph: the config's `setup` (its {placeholders} filled from the config; o, p: the
    original's and the proxy's settings), else our GRPO loop's."""
    o, p = cfg["original"], cfg["proxy"]
    if cfg.get("setup"):
        return " ".join(cfg["setup"].split()).format(**cfg, o=o, p=p) + "\n\n"
    return (
        f"Per seed (tuning seeds {cfg['tuning_seeds']}, held-out seeds {cfg['heldout_seeds']}; the seed is `--seed` "
        f"of every process: SFT initialisation, prompts, sampling, the random conversion): SFT "
        f"({cfg['sft_iters']} steps) + GRPO warm-up ({cfg['warmup_rl_iters']} steps) of the original "
        f"({o['num_experts']} experts, EP={o['expert_parallel']}, {o['ranks']} ranks), converted to "
        f"{p['num_experts']} experts at EP={p['expert_parallel']} ({p['ranks']} rank); each run {cfg['run_iters']} "
        f"GRPO steps from it, faults from step {cfg['onset']}, monitor on and recording its samples. Reward "
        f"collapse: the {cfg['collapse']['window']}-step mean reward below {cfg['collapse']['factor']} × its mean "
        "before the onset. A run the trainer stops at its first non-finite step (its default "
        "`--check-for-nan-in-loss-and-grad`, grad-overflow) is listed as stopped, not as a collapse.\n\n")


def markdown(cfg: dict, ctx: dict) -> str:
    """The page. `ctx`: data (pooled-calibrated records by (seed, run)), by_source ({original, proxy}: records),
    calibrations, noise (noise_floor_rows), e4, results (RunResult list), extra (command, wall, cpu, notes)."""
    seeds, data, extra = cfg["heldout_seeds"], ctx["data"], ctx["extra"]
    held = [s for s in seeds if any(k[0] == s for k in data)]
    e4_rows = [{"model": k, "eval_reward_after_conversion": v["before"], "eval_reward_after_rl": v["after"]}
               for k, v in (ctx.get("e4") or {}).items()]
    r3 = [{"seed": s, **row} for s in held for row in r3_verdicts(cfg, {n: d for (t, n), d in data.items() if t == s})]
    rate = cfg["false_alarms_per_1000_steps"]
    name = Path(cfg["config_path"]).stem
    parts = [
        f"# {cfg['title']}\n\n", protocol_text(cfg, ctx),
        f"Regenerate: `{extra['command']}` (sittings of "
        f"{', '.join(map(str, extra.get('sittings_min') or ['(not recorded)']))} min wall on {extra['cores']} "
        f"cores; the recorded stages: {extra['cpu_min']:.1f} CPU min, "
        f"{extra['wall_min']:.1f} min of stage wall time, concurrent proxy runs each counted; settings "
        f"`examples/configs/{name}.yaml`; raw `metrics.jsonl` and `monitor.jsonl` of every run, gzipped, "
        f"under `docs/results/{name}/<seed>/<run>/`, the monitor's samples cut to the statistics its "
        "detectors test: what `replay` reads, giving the same alerts).\n\n",
        setup_text(cfg),
        "**Protocol.** Thresholds come from `calibrate` (docs/monitor.md) on the healthy runs (original and proxy) "
        f"of the tuning seeds only, at R = {rate:g} runs with a false alarm per 1000 steps, form "
        f"`{cfg['calibrate_form']}`. Every alert on this page is the **replay** (`mindspeed-proxy replay`) of the "
        "run's recorded `monitor.jsonl` with that calibrated config; the alerts the runs raised online (with "
        f"`examples/configs/{cfg['monitor_config']}`) are not the reported ones. Only held-out seeds are in the "
        "tables. Every miss is reported as a miss.\n\n",
        "Thresholds (z, or the CUSUM's h) per statistic; `gumbel`: extrapolated from a Gumbel fit to the tuning "
        "runs' maximum scores, no distribution-free guarantee (an order statistic needs ≥ S/q − 1 tuning runs, q = "
        "R × run length / 1000, S statistics):\n\n",
        "".join(calibration_text(k, v) for k, v in ctx["calibrations"].items()), "\n", zero_threshold_text(ctx),
        "".join(f"- {note}\n" for note in extra.get("notes", [])) + ("\n" if extra.get("notes") else ""),
        "## Detection before the reward collapse (held-out seeds)\n\n",
        "Detected: the first alert at or after the onset comes strictly before the collapse. Lead: collapse − first "
        "alert, in steps and as a share of (collapse − onset), median [min, max] over detected runs. E2: the first "
        "alert's family is one the config expects for the fault.\n\n", _table(H.detection_rows(cfg, data, held)),
        "\n## False alarms on the held-out healthy runs\n\n",
        f"Every alert of a healthy run is false. **`calibrate` promises ≤ {rate:g} runs alarmed per 1000 steps** "
        "(runs as long as the tuning runs); measured on every held-out healthy run (the extra RL seeds included), "
        "with exact 95% intervals (Clopper–Pearson on runs alarmed / runs, scaled by 1000 / run length; Garwood "
        "on the alert count).\n\n",
        _table(H.false_alarm_rows(data, held)),
        f"\n{H.promise_verdict(data, held, rate)}.\n\nBy held-out warm-up seed:\n\n",
        _table(H.false_alarms_by_seed(data, held)),
        "\n## The proxy calibrates the original\n\n",
        "The original's held-out runs replayed with thresholds calibrated on the proxy's healthy tuning runs only, "
        "next to thresholds calibrated on the original's own healthy tuning runs.\n\n",
        _table(H.transfer_rows(cfg, ctx["by_source"], held)),
        f"\nWithin 2× of the original-calibrated rate: {H.transfer_verdict(ctx['by_source'], held)}.\n",
        "\n## E3: does the proxy reproduce the original? (new form)\n\n",
        f"Curves: {cfg['pearson_smoothing']}-step trailing mean reward. Distance: mean absolute difference over the "
        "common steps. Band: the largest original-vs-original distance across the held-out seeds (per fault). Per "
        "seed: the proxy's distance to that seed's original ≤ band; same collapse outcome (collapsed or not); same "
        "first-alert family (none = none). Met when all three hold on every seed. The old column: Pearson of the "
        "same curves per seed.\n\n", _table(H.e3_band_rows(cfg, data, held)),
        *(["\n## lowp-attention: the attention-spectral statistics' noise floor vs the fault's signal\n\n",
           "Per seed: the healthy run's standard deviation across its samples (after `detect_start`) of each tested "
           "attention-spectral statistic (layer mean), and the lowp-attention run's mean shift from the healthy run "
           "over the same steps after the onset (same seed, same warm-up, so the shift is the fault's).\n\n",
           _table(ctx["noise"]),
           "\n" + H.noise_floor_verdict(ctx["noise"], cfg["faults"]["lowp-attention"])]
          if "lowp-attention" in cfg["faults"] else []),  # sections of what the config does not run are left out
        "\n## Every held-out run\n\n", _table(run_rows(cfg, data, held)),
        *(["\nR3 control (routing replay of the rollout's routing): the routing-mismatch alerts must vanish.\n\n",
           _table(r3)] if cfg["r3_controls"] else []),
        *(["\n## Train–rollout logprob-gap decomposition (every recorded run; steps from the onset; shares of "
           "Σ|term|)\n\n", _table(gap)] if (gap := gap_rows(cfg, data)) else []),
        *([f"\n## E4: task reward (held-out prompts, seed {cfg['heldout_seeds'][0]})\n\n", _table(e4_rows)]
          if cfg.get("e4_eval_prompts") else []),
        "\n## Cost (every recorded stage, all seeds)\n\n", _table(cost_rows(ctx["results"])),
    ]
    return "".join(parts)
