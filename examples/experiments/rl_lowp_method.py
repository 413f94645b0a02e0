"""lowp-attention in RL: the RL matrix's attention-spectral detector against method changes, each calibrated on
the tuning seeds' healthy runs only and replayed on the held-out seeds' healthy and lowp-attention runs.

    OMP_NUM_THREADS=1 .venv/bin/python examples/experiments/rl_lowp_method.py [--work-dir runs/rl_fault_matrix]
        [--out docs/results/rl_lowp_attention.md]

Reads the full monitor.jsonl of each run in the matrix's work dir (the raw files under docs/results keep only the
statistics the matrix tests, so this needs the work dir of `rl_fault_matrix.py`). Only the attention-spectral
family is calibrated and replayed here, at the matrix's false-alarm rate for that family alone.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# name -> (what changes, overrides of the matrix's monitor config, calibrated detector form)
VARIANTS = {
    "matrix": ("the matrix's detector: layer mean of Δ2 entropy / effective rank / top-1 energy, EMA z-score",
               {}, None),
    "layer-cusum": ("per layer and layer mean of Δ2 Frobenius norm / effective rank, frozen baseline + CUSUM "
                    "(accumulates a sustained shift smaller than one noise SD)",
                    {"detect_metrics": {"attention-spectral": ["delta2/frobenius", "delta2/effective_rank"]},
                     "detect_scopes": {"attention-spectral": ["layer", "mean"]}}, "cusum"),
    "mean-ema-cusum": ("layer mean of Δ2 Frobenius norm / effective rank, EMA baseline + CUSUM",
                       {"detect_metrics": {"attention-spectral": ["delta2/frobenius", "delta2/effective_rank"]},
                        "detect_scopes": {"attention-spectral": ["mean"]}}, "ema-cusum"),
}


def variant_base(cfg: dict, overrides: dict, path: str) -> None:
    """The matrix's monitor YAML restricted to the attention-spectral family, with `overrides`, written to `path`."""
    base = yaml.safe_load(open(os.path.join(os.path.dirname(cfg["config_path"]), cfg["monitor_config"])))
    base["families"] = ["attention-spectral"]
    for key, value in overrides.items():
        base[key] = {**base.get(key, {}), **value}
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(base, fh)


def evaluate(cfg: dict, stages: dict, name: str, tmp: str) -> dict:
    """Calibrate variant `name` on the tuning seeds' healthy runs; replay it on the held-out seeds' runs."""
    from mindspeed_proxy.experiments import rl_heldout as H
    from mindspeed_proxy.experiments.matrix import fault_onset
    from mindspeed_proxy.experiments.rl_calibration import calibrate_runs, replayed_alerts
    from mindspeed_proxy.report.calibrate_cli import write_config
    from mindspeed_proxy.experiments.rl_tables import run_data

    _, overrides, form = VARIANTS[name]
    base = os.path.join(tmp, f"{name}_base.yaml")
    variant_base(cfg, overrides, base)
    tuning = [stages[(s, f"{m}_none")].run_dir for s in cfg["tuning_seeds"] for m in H.MODELS
              if (s, f"{m}_none") in stages]
    config, results, uncalibrated = calibrate_runs(tuning, base, cfg["false_alarms_per_1000_steps"],
                                                   form or cfg["calibrate_form"])
    calibrated = os.path.join(tmp, f"{name}.yaml")
    write_config(config, calibrated)
    rows = []
    for model in H.MODELS:
        for fault in ("none", "lowp-attention"):
            recs = []
            for seed in cfg["heldout_seeds"]:
                r = stages.get((seed, f"{model}_{fault}"))
                if r is not None:
                    recs.append((seed, run_data(r.run_dir, fault_onset(r.spec), cfg["collapse"],
                                                alerts=replayed_alerts(r.run_dir, calibrated))))
            if not recs:
                continue
            if fault == "none":
                fa = H.false_alarm_row(model, [d for _, d in recs])
                result = f"{fa['alerts']} alerts, {fa['runs alarmed']} / {fa['count']} runs alarmed in {fa['steps']} steps"
            else:
                det = H.detection([d for _, d in recs])
                per_seed = "; ".join(f"seed {s}: first alert {d['first']['step'] if d['first'] else 'none'}, "
                                     f"collapse {d['collapse'] if d['collapse'] is not None else 'none'}"
                                     for s, d in recs)
                result = f"{det['detected']} / {det['collapsed']} detected before collapse ({per_seed})"
            rows.append({"detector": name, "model": model, "runs": f"{fault} × {len(recs)}", "result": result})
    thresholds = "; ".join(f"{'/'.join(s)}: {r['threshold']:.3g}" for s, r in sorted(results.items()))
    return {"rows": rows, "thresholds": thresholds or "none", "uncalibrated": "; ".join(f"{k}: {v}" for k, v in uncalibrated.items()) or "none"}


def main(argv=None) -> int:
    """Evaluate every variant and write the page."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "rl_fault_matrix"))
    p.add_argument("--config", default=os.path.join(ROOT, "examples", "configs", "rl_fault_matrix.yaml"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "rl_lowp_attention.md"))
    a = p.parse_args(argv)
    from mindspeed_proxy.experiments.rl_matrix import load_rl_config
    from mindspeed_proxy.experiments.rl_page import _table
    from mindspeed_proxy.experiments.rl_results import collect

    cfg = load_rl_config(a.config)
    stages = collect(os.path.abspath(a.work_dir), [*cfg["tuning_seeds"], *cfg["heldout_seeds"]])
    rows, cal = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (what, _, form) in VARIANTS.items():
            out = evaluate(cfg, stages, name, tmp)
            rows += out["rows"]
            cal.append({"detector": name, "what": what, "form": form or cfg["calibrate_form"],
                        "thresholds (tuning seeds)": out["thresholds"], "uncalibrated": out["uncalibrated"]})
    seeds = sorted({s for s, n in stages if n.endswith("lowp-attention") and s in cfg["heldout_seeds"]})
    page = ("# lowp-attention in RL: detector variants\n\nRegenerate: `OMP_NUM_THREADS=1 .venv/bin/python "
            "examples/experiments/rl_lowp_method.py` after `examples/experiments/rl_fault_matrix.py` (it reads the "
            "matrix's work dir). Each variant: attention-spectral only, calibrated by `calibrate` on the healthy runs "
            f"of tuning seeds {cfg['tuning_seeds']} (original and proxy) at ≤ {cfg['false_alarms_per_1000_steps']:g} "
            f"runs alarmed per 1000 steps, replayed on held-out seeds {seeds}. Detected: the first alert at or after "
            "the onset strictly before the reward collapse.\n\n" + _table(cal) + "\n" + _table(rows))
    with open(a.out, "w", encoding="utf-8") as fh:
        fh.write(page)
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
