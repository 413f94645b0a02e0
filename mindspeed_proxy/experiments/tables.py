"""The fault matrix's tables (E1 lead time, E2 orthogonality, E3 proxy consistency, E4 capability, cost),
computed from recorded runs with the report/compare modules, and the markdown page that holds them."""
from __future__ import annotations

import statistics
from pathlib import Path

from mindspeed_proxy.report.compare import Thresholds, compare_runs
from mindspeed_proxy.report.divergence import DivergenceRule
from mindspeed_proxy.report.report import summarize
from mindspeed_proxy.report.runs import FAMILIES, load_run
from mindspeed_proxy.experiments.matrix import fault_onset


def rule_of(cfg: dict) -> DivergenceRule:
    """The divergence rule the config names."""
    return DivergenceRule(**cfg.get("divergence", {}))


def analyse(cfg: dict, results: list) -> dict:
    """Per-run summaries and per-fault original-vs-proxy comparisons of finished runs."""
    rule = rule_of(cfg)
    runs = {}
    for r in results:
        run = load_run(r.run_dir)
        s = summarize(run, rule)
        onset = fault_onset(r.spec)
        per_fam = {f: sorted({a["step"] for a in run.alerts if a.get("family") == f}) for f in FAMILIES}
        med_step = statistics.median(s_["step_time_s"] for s_ in _steps(run.path)) if run.steps else None
        runs[r.name] = {**r.to_dict(), "summary": s, "onset": onset, "alert_steps": per_fam,
                        "alerts_before_onset": sum(1 for a in run.alerts if onset is not None and a["step"] < onset),
                        "median_step_s": med_step}
    comparisons = {}
    for fault in cfg["faults"]:
        a, b = runs.get(f"original_{fault}"), runs.get(f"proxy_{fault}")
        if a and b:
            comparisons[fault] = compare_runs(a["run_dir"], b["run_dir"], rule, Thresholds())
    return {"runs": runs, "comparisons": comparisons}


def _steps(path: Path) -> list[dict]:
    """Step records of a run's metrics.jsonl."""
    import json

    return [json.loads(line) for line in open(Path(path) / "metrics.jsonl") if '"type": "step"' in line]


def _first_after(steps: list[int], onset) -> int | None:
    """The first step ≥ onset (any step when onset is None)."""
    hits = [s for s in steps if onset is None or s >= onset]
    return hits[0] if hits else None


def e1_rows(cfg: dict, data: dict) -> list[dict]:
    """E1: per faulted run, first alert per family, divergence, and the lead ratio against the target."""
    target = cfg.get("e1_target_ratio", 0.5)
    rows = []
    for name, r in data["runs"].items():
        if r["onset"] is None:
            continue
        onset, div = r["onset"], r["summary"]["divergence_step"]
        firsts = {f: _first_after(r["alert_steps"][f], onset) for f in FAMILIES}
        expected = cfg["expected_families"].get(r["fault"]) or FAMILIES
        first = min((firsts[f] for f in expected if firsts[f] is not None), default=None)
        if div is None:
            ratio, verdict = None, "MISSED: no divergence within the run"
        elif first is None:
            ratio, verdict = None, "MISSED: no alert from " + ", ".join(expected)
        else:
            ratio = (first - onset) / max(div - onset, 1)
            verdict = "met" if (first <= div and ratio <= target) else (
                f"MISSED: ratio {ratio:.2f} > {target}" if first <= div else "MISSED: alert after divergence")
        rows.append({"run": name, "fault": r["fault"], "model": r["model"], "onset": onset, "firsts": firsts,
                     "first": first, "divergence": div, "reason": r["summary"]["divergence_reason"],
                     "ratio": ratio, "verdict": verdict})
    return rows


def e2_rows(cfg: dict, data: dict) -> list[dict]:
    """E2: per run, alerts per family from onset up to the divergence step (the diagnostic window; the whole
    run when healthy or not diverged) against the expectation; alerts after divergence are counted apart."""
    rows = []
    for name, r in data["runs"].items():
        expected = set(cfg["expected_families"].get(r["fault"]) or [])
        lo, hi = r["onset"] or 0, r["summary"]["divergence_step"]
        after = {f: [s for s in r["alert_steps"][f] if s >= lo] for f in FAMILIES}
        counts = {f: [s for s in v if hi is None or s <= hi] for f, v in after.items()}
        late = {f: len(after[f]) - len(counts[f]) for f in FAMILIES}
        fired = {f for f, s in counts.items() if s}
        if r["onset"] is None:
            verdict = "met (0 alerts)" if not fired else f"MISSED: {sum(map(len, counts.values()))} alert(s)"
        else:
            missing, extra = expected - fired, fired - expected
            verdict = "met" if not (missing or extra) else "MISSED: " + "; ".join(
                ([f"silent: {', '.join(sorted(missing))}"] if missing else []) +
                ([f"also fired: {', '.join(sorted(extra))}"] if extra else []))
        rows.append({"run": name, "fault": r["fault"], "model": r["model"], "counts": counts, "late": late,
                     "expected": sorted(expected), "verdict": verdict, "divergence": hi,
                     "before_onset": r["alerts_before_onset"]})
    return rows


def e3_pair(fault: str, c: dict) -> dict:
    """E3 of one original-vs-proxy `compare_runs` result under `fault`: the targets missed (`failed`, empty when
    met): same divergence outcome, first alerts within ±alert_tolerance (or neither alerts), and for the healthy
    pair only, loss Pearson ≥ min_loss_pearson."""
    a, b = c["a"], c["b"]
    fa, fb = a["first_alert_step"], b["first_alert_step"]
    within = None if fa is None or fb is None else abs(fb - fa) <= c["thresholds"]["alert_tolerance"] * fa
    pearson_ok = fault != "none" or (c["loss"]["pearson"] or 0) >= c["thresholds"]["min_loss_pearson"]
    alerts_ok = within if within is not None else (fa is None and fb is None)
    failed = ([] if a["diverged"] == b["diverged"] else ["divergence outcome differs"]) + \
        ([] if alerts_ok else ["first alerts differ"]) + ([] if pearson_ok else ["healthy loss Pearson < target"])
    return {"failed": failed, "within": within, "same_div": a["diverged"] == b["diverged"]}


def reproduction_verdict(fault: str, c: dict) -> str:
    """One line: did the proxy reproduce the original's outcome under `fault`, by `e3_pair` (the E3 targets)."""
    e3, a, b, th = e3_pair(fault, c), c["a"], c["b"], c["thresholds"]
    rule = f"same divergence outcome, first alerts within ±{th['alert_tolerance']:.0%}" + (
        f", loss Pearson ≥ {th['min_loss_pearson']}" if fault == "none" else "")
    return (f"verdict: the proxy {'reproduced' if not e3['failed'] else 'did NOT reproduce'} "
            f"{'the healthy run' if fault == 'none' else 'the fault'} (rule: the fault matrix's E3 targets for the "
            f"pair: {rule}): divergence original {a['divergence_step']} / proxy {b['divergence_step']}, first alert "
            f"{a['first_alert_step']} ({a['first_alert_family']}) / {b['first_alert_step']} ({b['first_alert_family']})"
            + ("" if not e3["failed"] else "; missed: " + "; ".join(e3["failed"])))


def e3_rows(cfg: dict, data: dict) -> list[dict]:
    """E3: per fault, the compare verdict of original vs proxy and the three targets separately."""
    rows = []
    for fault, c in data["comparisons"].items():
        a, b = c["a"], c["b"]
        e3 = e3_pair(fault, c)
        rows.append({"fault": fault, "result": "met" if not e3["failed"] else "MISSED: " + "; ".join(e3["failed"]),
                     "div_a": a["divergence_step"], "div_b": b["divergence_step"],
                     "same_div": e3["same_div"], "alert_a": a["first_alert_step"], "alert_b": b["first_alert_step"],
                     "fam_a": a["first_alert_family"], "fam_b": b["first_alert_family"], "within": e3["within"],
                     "pearson": c["loss"]["pearson"], "spearman": c["loss"]["spearman"],
                     "pearson_pre": c["loss_before_divergence"]["pearson"],
                     "verdict": c["verdict"], "reasons": c["reasons"]})
    return rows


def cost_rows(data: dict, fault: str = "none") -> list[dict]:
    """Cost per model from its run under `fault` (else its first run), runs from step 0 only (a branch ran fewer
    steps than its `iters`): ranks, CPU-s and rank-seconds per step."""
    rows = []
    whole = {k: x for k, x in data["runs"].items() if not x.get("branched_from")}
    for model in ("original", "proxy"):
        r = whole.get(f"{model}_{fault}") or next((x for x in whole.values() if x["model"] == model), None)
        if r:
            rows.append({"model": model, "fault": r["fault"], "ranks": r["ranks"], "iters": r["iters"], "cpu_s": r["cpu_s"],
                         "cpu_per_step": r["cpu_s"] / r["iters"], "wall_s": r["wall_s"],
                         "median_step_s": r["median_step_s"],
                         "rank_s_per_step": r["ranks"] * r["median_step_s"]})
    return rows


def _c(v, fmt="{}") -> str:
    """A table cell; '—' for None."""
    return "—" if v is None else fmt.format(v)


def markdown(cfg: dict, data: dict, e4: dict | None, extra: dict) -> str:
    """The docs/results/fault_matrix.md page."""
    L = ["# Fault matrix: mechanism monitors on the original vs its proxy", "",
         f"Generated by `examples/experiments/fault_matrix.py` ({cfg['mode']} mode, {extra['seconds']:.0f} s wall on "
         f"{extra['cpus']} CPU cores, load average at start {extra['load_start']}, at end {extra['load_end']}"
         + ("" if extra.get("steal") is None else f", CPU steal {extra['steal']:.0%} (time the VM's cores ran other "
            "guests)") + "). "
         f"Training runs: {sum(r['wall_s'] for r in data['runs'].values()):.0f} s wall, "
         f"{sum(r['cpu_s'] for r in data['runs'].values()):.0f} CPU-s in total"
         + (" (runs and E4 reused from an earlier invocation with the same settings, `--reuse`; their times are "
            "those of that invocation)." if extra.get("reuse") else ".") + " Regenerate with:", "", "```",
         extra["command"], "```", "",
         f"Original: tiny megatron-core GPT-MoE ({cfg['original']['num_experts']} experts, top-2, 4 layers, hidden 64), "
         f"{cfg['original']['ranks']} gloo ranks at EP={cfg['original']['expert_parallel']}; healthy warm-up of "
         f"{cfg['warmup']['iters']} steps. Proxy: that checkpoint through `convert_to_proxy.py` to "
         f"{cfg['proxy']['num_experts']} experts at EP={cfg['proxy']['expert_parallel']} on {cfg['proxy']['ranks']} "
         f"rank (kept experts per layer: {extra.get('kept')}). Every run loads its checkpoint with `--finetune "
         f"--no-load-optim --no-load-rng` (weights only, step 0, fresh Adam, same data order and seed), trains "
         f"{cfg['run']['iters']} steps at constant LR, monitor config `{Path(cfg['monitor_config']).name}`. "
         "Divergence: " + rule_of(cfg).as_dict()["definition"] +
         f" ({', '.join(f'{k}={v}' for k, v in cfg.get('divergence', {}).items())}).", ""]
    L += ["## Settings", "", "| fault | spec (`--inject-fault`) | expected families |", "|---|---|---|"]
    for f, spec in cfg["faults"].items():
        L.append(f"| {f} | `{spec or '—'}` | {', '.join(cfg['expected_families'][f]) or 'none (0 alerts)'} |")
    if cfg.get("notes"):
        L += ["", "Why these settings (the config's `notes`):", ""] + [f"- {n}" for n in cfg["notes"]]
    target = cfg.get("e1_target_ratio", 0.5)
    L += ["", f"## E1 lead time (target: (first alert − onset) ≤ {target} × (divergence − onset))", "",
          "| fault | model | onset | attention-spectral | update-spectral | router | divergence (reason) | ratio | result |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in e1_rows(cfg, data):
        f = r["firsts"]
        L.append(f"| {r['fault']} | {r['model']} | {r['onset']} | {_c(f['attention-spectral'])} | "
                 f"{_c(f['update-spectral'])} | {_c(f['router'])} | "
                 f"{_c(r['divergence'])} ({r['reason']}) | {_c(r['ratio'], '{:.2f}')} | {r['verdict']} |")
    L += ["", "Cells: first alert step of each family at or after the onset (— = none). The ratio uses the first "
          "alert of the fault's expected families (Settings); a different family's alert does not count as a lead.", "",
          "## E2 orthogonality", "", "Alerts per family from the fault onset up to the divergence step (the "
          "diagnostic window: which mechanism the monitor names before the loss goes; the whole run when healthy "
          "or not diverged), `+n late` = further alerts after divergence, when everything moves. Target: the "
          "expected families fire, the others stay silent; the healthy run has 0 alerts.", "",
          "| fault | model | divergence | attention-spectral | update-spectral | router | expected | alerts before onset "
          "| result |", "|---|---|---|---|---|---|---|---|---|"]
    for r in e2_rows(cfg, data):
        cells = [f"{len(s)}" + (f" (from {s[0]})" if s else "") + (f" +{r['late'][f]} late" if r["late"][f] else "")
                 for f, s in r["counts"].items()]
        L.append(f"| {r['fault']} | {r['model']} | {_c(r['divergence'])} | " + " | ".join(cells) +
                 f" | {', '.join(r['expected']) or 'none'} | {r['before_onset']} | {r['verdict']} |")
    th = Thresholds()
    L += ["", "## E3 proxy consistency", "", f"Targets: the proxy diverges iff the original does, its first alert "
          f"within ±{th.alert_tolerance:.0%} of the original's step (or neither alerts), healthy loss curves Pearson ≥ "
          f"{th.min_loss_pearson}. `compare` verdict: `mindspeed-proxy compare original proxy`, which also asks "
          f"Pearson ≥ {th.min_loss_pearson} of faulted runs on the steps before the first divergence (after it "
          "the two losses blow up differently).", "",
          "| fault | divergence orig / proxy | same outcome | first alert orig / proxy | within ±25% | "
          "loss Pearson / Spearman (all steps) | Pearson before divergence | result | compare verdict |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in e3_rows(cfg, data):
        L.append(f"| {r['fault']} | {_c(r['div_a'])} / {_c(r['div_b'])} | {'yes' if r['same_div'] else 'NO'} | "
                 f"{_c(r['alert_a'])} ({_c(r['fam_a'])}) / {_c(r['alert_b'])} ({_c(r['fam_b'])}) | "
                 f"{_c(r['within'] and 'yes' or (r['within'] is False and 'NO' or None))} | "
                 f"{_c(r['pearson'], '{:.3f}')} / {_c(r['spearman'], '{:.3f}')} | {_c(r['pearson_pre'], '{:.3f}')} | "
                 f"{r['result']} | {r['verdict']}"
                 + (f": {'; '.join(r['reasons'])}" if r["reasons"] else "") + " |")
    if e4:
        L += ["", "## E4 capability retention (eval loss on held-out data, no fine-tuning after conversion)", "",
              e4["description"], "", "| K | selection | eval loss | Δ vs original |", "|---|---|---|---|"]
        for row in e4["rows"]:
            val = f"{row['loss']:.4f}" + (f" ± {row['std']:.4f}" if row.get("std") is not None else "")
            L.append(f"| {row['k']} | {row['selection']} | {val} | {row['loss'] - e4['rows'][0]['loss']:+.4f} |")
    cost = cost_rows(data)
    if len(cost) == 2:
        o, p = cost
        L += ["", "## Cost", "",
              "| model | run | ranks | CPU-s per step (whole process tree incl. start-up / steps) | median step wall (s) | "
              "rank-seconds per step |", "|---|---|---|---|---|---|"]
        for r in cost:
            L.append(f"| {r['model']} | {r['fault']} | {r['ranks']} | {r['cpu_per_step']:.3f} ({r['cpu_s']:.0f} s / {r['iters']}) | "
                     f"{r['median_step_s']:.3f} | {r['rank_s_per_step']:.3f} |")
        L += ["", f"Proxy vs original: {1 - p['ranks'] / o['ranks']:.0%} fewer ranks, "
              f"{o['cpu_per_step'] / p['cpu_per_step']:.2f}× less CPU per step, "
              f"{o['rank_s_per_step'] / p['rank_s_per_step']:.2f}× fewer rank-seconds per step "
              "(the paper: 50–87.5% fewer accelerators, up to 33.3× lower per-step cost). CPU seconds are "
              "`os.wait4` rusage of each torchrun tree (all ranks), so they include process start-up and "
              "checkpoint load; rank-seconds use the trainer's per-step wall time. The machine is shared: "
              "wall times are inflated by other load."]
    folder = extra.get("folder", "fault_matrix")
    L += ["", "## Plots and raw data", "", f"Per run, in `{folder}/<run>/`: the report's "
          "`loss_grad_norm.png` and per-family `*_aggregate.png` (baseline band, alerts), `summary.md`/`summary.html`; "
          f"raw records in `{folder}/raw/<run>.{{metrics,monitor}}.jsonl.gz`; every number on this page "
          f"in `{folder}/results.json`.", ""]
    for name, r in data["runs"].items():
        since = (f" (continued `{r['branched_from']}`'s checkpoint of step {r['branch_step']}, before its fault: "
                 f"its records start at step {r['branch_step'] + 1})") if r.get("branched_from") else ""
        L.append(f"- `{name}`{since}: [summary]({folder}/{name}/summary.md), "
                 f"![{name} loss]({folder}/{name}/loss_grad_norm.png)")
    return "\n".join(L) + "\n"
