"""The RL fault matrix's results page (docs/results/rl_fault_matrix.md) from the held-out tables."""
from __future__ import annotations

from mindspeed_proxy.experiments import rl_heldout as H
from mindspeed_proxy.experiments.rl_tables import _label, _table, gap_rows, r3_verdicts


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
        kind = r.name.split("_")[0] if r.name.startswith(("sft", "warmup", "convert", "e4")) else f"run ({r.model})"
        k = kinds.setdefault(kind, {"stage": kind, "count": 0, "steps": 0, "wall_s": 0.0, "cpu_s": 0.0})
        k["count"] += 1
        k["steps"] += r.iters
        k["wall_s"] += r.wall_s
        k["cpu_s"] += r.cpu_s
    rows = list(kinds.values())
    for k in rows:
        k["wall_s_per_step"] = k["wall_s"] / k["steps"] if k["steps"] else None
    rows.append({"stage": "total", "count": sum(k["count"] for k in rows), "steps": sum(k["steps"] for k in rows),
                 "wall_s": sum(k["wall_s"] for k in rows), "cpu_s": sum(k["cpu_s"] for k in rows),
                 "wall_s_per_step": None})
    return rows


def calibration_text(name: str, cal: dict) -> str:
    """One calibration's summary line: thresholds, and the statistics left at the base config's detector."""
    if "error" in cal:
        return f"- **{name}** ({cal['runs']} runs): calibration FAILED: {cal['error']}\n"
    ths = ", ".join(f"{k} {v['threshold']:.3g} ({v['tail']})" for k, v in cal["thresholds"].items()) or "none"
    unc = ", ".join(f"{k} ({'all scores equal' if 'no spread' in v else v})" for k, v in cal["uncalibrated"].items())
    return (f"- **{name}** ({cal['runs']} healthy tuning runs): {ths}" +
            (f". Left at the base config's detector (no threshold from these runs): {unc}" if unc else "") + "\n")


def markdown(cfg: dict, ctx: dict) -> str:
    """The page. `ctx`: data (pooled-calibrated records by (seed, run)), by_source ({original, proxy}: records),
    calibrations, noise (noise_floor_rows), e4, results (RunResult list), extra (command, wall, cpu, notes)."""
    seeds, data, extra = cfg["heldout_seeds"], ctx["data"], ctx["extra"]
    held = [s for s in seeds if any(k[0] == s for k in data)]
    e4_rows = [{"model": k, "eval_reward_after_conversion": v["before"], "eval_reward_after_rl": v["after"]}
               for k, v in (ctx.get("e4") or {}).items()]
    r3 = [{"seed": s, **row} for s in held for row in r3_verdicts(cfg, {n: d for (t, n), d in data.items() if t == s})]
    rate = cfg["false_alarms_per_1000_steps"]
    o, p = cfg["original"], cfg["proxy"]
    parts = [
        "# RL fault matrix (GRPO): original vs proxy, held-out seeds\n\n",
        f"Regenerate: `{extra['command']}` (sittings of "
        f"{', '.join(map(str, extra.get('sittings_min') or ['(not recorded)']))} min wall on {extra['cores']} "
        f"cores; the recorded stages: {extra['cpu_min']:.1f} CPU min, "
        f"{extra['wall_min']:.1f} min of stage wall time, concurrent proxy runs each counted; settings "
        "`examples/configs/rl_fault_matrix.yaml`; raw `metrics.jsonl` and `monitor.jsonl` of every run, gzipped, "
        "under `docs/results/rl_fault_matrix/<seed>/<run>/`, the monitor's samples cut to the statistics its "
        "detectors test: what `replay` reads, giving the same alerts).\n\n",
        f"Per seed (tuning seeds {cfg['tuning_seeds']}, held-out seeds {cfg['heldout_seeds']}; the seed is `--seed` "
        f"of every process: SFT initialisation, prompts, sampling, the random conversion): SFT "
        f"({cfg['sft_iters']} steps) + GRPO warm-up ({cfg['warmup_rl_iters']} steps) of the original "
        f"({o['num_experts']} experts, EP={o['expert_parallel']}, {o['ranks']} ranks), converted to "
        f"{p['num_experts']} experts at EP={p['expert_parallel']} ({p['ranks']} rank); each run {cfg['run_iters']} "
        f"GRPO steps from it, faults from step {cfg['onset']}, monitor on and recording its samples. Reward "
        f"collapse: the {cfg['collapse']['window']}-step mean reward below {cfg['collapse']['factor']} × its mean "
        "before the onset. A run the trainer stops at its first non-finite step (its default "
        "`--check-for-nan-in-loss-and-grad`, grad-overflow) is listed as stopped, not as a collapse.\n\n",
        "**Protocol.** Thresholds come from `calibrate` (docs/monitor.md) on the healthy runs (original and proxy) "
        f"of the tuning seeds only, at R = {rate:g} runs with a false alarm per 1000 steps, form "
        f"`{cfg['calibrate_form']}`. Every alert on this page is the **replay** (`mindspeed-proxy replay`) of the "
        "run's recorded `monitor.jsonl` with that calibrated config; the alerts the runs raised online (with "
        f"`examples/configs/{cfg['monitor_config']}`) are not the reported ones. Only held-out seeds are in the "
        "tables. Every miss is reported as a miss.\n\n",
        "Thresholds (z, or the CUSUM's h) per statistic; `gumbel`: extrapolated from a Gumbel fit to the tuning "
        "runs' maximum scores, no distribution-free guarantee (an order statistic needs ≥ S/q − 1 tuning runs, q = "
        "R × run length / 1000, S statistics):\n\n",
        "".join(calibration_text(k, v) for k, v in ctx["calibrations"].items()), "\n",
        "".join(f"- {note}\n" for note in extra.get("notes", [])) + ("\n" if extra.get("notes") else ""),
        "## Detection before the reward collapse (held-out seeds)\n\n",
        "Detected: the first alert at or after the onset comes strictly before the collapse. Lead: collapse − first "
        "alert, in steps and as a share of (collapse − onset), median [min, max] over detected runs. E2: the first "
        "alert's family is one the config expects for the fault.\n\n", _table(H.detection_rows(cfg, data, held)),
        "\n## False alarms on the held-out healthy runs\n\n",
        f"Every alert of a healthy run is false. `calibrate` promises ≤ {rate:g} runs alarmed per 1000 steps.\n\n",
        _table(H.false_alarm_rows(data, held)),
        "\n## The proxy calibrates the original\n\n",
        "The original's held-out runs replayed with thresholds calibrated on the proxy's healthy tuning runs only, "
        "next to thresholds calibrated on the original's own healthy tuning runs.\n\n",
        _table(H.transfer_rows(cfg, ctx["by_source"], held)),
        "\n## E3: does the proxy reproduce the original? (new form)\n\n",
        f"Curves: {cfg['pearson_smoothing']}-step trailing mean reward. Distance: mean absolute difference over the "
        "common steps. Band: the largest original-vs-original distance across the held-out seeds (per fault). Per "
        "seed: the proxy's distance to that seed's original ≤ band; same collapse outcome (collapsed or not); same "
        "first-alert family (none = none). Met when all three hold on every seed. The old column: Pearson of the "
        "same curves per seed.\n\n", _table(H.e3_band_rows(cfg, data, held)),
        "\n## lowp-attention: the attention-spectral statistics' noise floor vs the fault's signal\n\n",
        "Per seed: the healthy run's standard deviation across its samples (after `detect_start`) of each tested "
        "attention-spectral statistic (layer mean), and the lowp-attention run's mean shift from the healthy run "
        "over the same steps after the onset (same seed, same warm-up, so the shift is the fault's).\n\n",
        _table(ctx["noise"]),
        "\n## Every held-out run\n\n", _table(run_rows(cfg, data, held)),
        "\nR3 control (routing replay of the rollout's routing): the routing-mismatch alerts must vanish.\n\n",
        _table(r3),
        *(["\n## Train–rollout logprob-gap decomposition (every recorded run; steps from the onset; shares of "
           "Σ|term|)\n\n", _table(gap)] if (gap := gap_rows(cfg, data)) else []),
        f"\n## E4: task reward (held-out prompts, seed {cfg['heldout_seeds'][0]})\n\n", _table(e4_rows),
        "\n## Cost (every recorded stage, all seeds)\n\n", _table(cost_rows(ctx["results"])),
    ]
    return "".join(parts)
