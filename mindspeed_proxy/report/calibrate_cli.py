"""`mindspeed-proxy calibrate RUN_DIR... --false-alarms-per-1000-steps R --out monitor.yaml`.

Chooses each tested statistic's detector threshold from the recorded samples of healthy runs so that
runs like them raise at most R false alarms per 1000 steps (docs/monitor.md, "Calibrated thresholds"),
optionally compares detector forms on held-out healthy runs, and writes a MonitorConfig that the online
monitor (--mechanism-monitor-config) and `replay` read.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from mindspeed_proxy.cli import error
from mindspeed_proxy.extras import MissingExtra, require
from mindspeed_proxy.monitor.calibration import (FORMS, TAILS, ZERO_THRESHOLD_MEANING, CalibrationError,
                                                calibrate_statistics)
from mindspeed_proxy.monitor.config import MonitorConfig
from mindspeed_proxy.monitor.detectors import FAMILIES
from mindspeed_proxy.report.replay import per_layer_metrics, replay_alerts
from mindspeed_proxy.report.runs import Run, RunError, load_run


def run_steps(run: Run) -> int:
    """A run's length in training steps: its metrics.jsonl steps, else the last sampled step."""
    if run.steps:
        return len(run.steps)
    return max((s["step"] for samples in run.samples.values() for s in samples), default=0)


def healthy_run(path: str) -> Run:
    """Load a run dir that must hold monitor samples and no injected fault (RunError otherwise)."""
    run = load_run(path)
    if not run.samples:
        raise RunError(f"{path}: no healthy samples (mechanism_monitor/monitor.jsonl missing or without samples)")
    if run.faults:
        raise RunError(f"{path}: not a healthy run (its monitor.jsonl records injected faults {run.faults})")
    return run


def run_series(run: Run, config: MonitorConfig) -> dict:
    """{(family, metric): [values of each series]} of the statistics `config` tests, as its detectors see them."""
    series: dict = {}
    for family, samples in run.samples.items():
        if family not in config.families or family not in FAMILIES:
            continue
        for sample in samples:
            if sample["step"] < config.detect_start:
                continue
            values = config.detection_series(family, per_layer_metrics(family, sample["layers"]))
            for key, value in values.items():
                series.setdefault((family, key[1]), {}).setdefault(key, []).append(value)
    return {stat: list(by_key.values()) for stat, by_key in series.items()}


def base_configs(config: MonitorConfig, stats) -> dict:
    """{(family, metric): the DetectorConfig its detector starts from (direction included)}."""
    banks = config.detector_banks()
    return {(f, m): banks[f].detector((f, m, None, None)).config for f, m in stats}


def calibrated_config(config: MonitorConfig, results: dict, meta: dict) -> MonitorConfig:
    """`config` with the calibrated per-statistic overrides in `metric_detectors` and provenance in `calibration`."""
    data = config.to_dict()
    metric_detectors = {f: dict(m) for f, m in data.get("metric_detectors", {}).items()}
    for (family, metric), res in results.items():
        metric_detectors.setdefault(family, {})[metric] = {**metric_detectors.get(family, {}).get(metric, {}),
                                                           **res["overrides"]}
    data["metric_detectors"] = metric_detectors
    data["calibration"] = {**meta, "statistics": {
        f"{f}/{m}": {k: res[k] for k in ("threshold", "tail", "k", "runs", "promised")}
        for (f, m), res in sorted(results.items())}}
    data.pop("output_dir", None)  # the run that uses it chooses its own
    return MonitorConfig.from_dict(data)


def false_alarms(runs: list[Run], config: MonitorConfig, stats) -> dict:
    """Threshold/CUSUM alerts of the calibrated statistics that `config` raises on `runs` (healthy)."""
    steps = sum(run_steps(r) for r in runs)
    alarmed, alerts = 0, 0
    for run in runs:
        hits = [a for a in replay_alerts(run, config)
                if a["kind"] != "non-finite" and (a["family"], a["metric"]) in stats]
        alarmed += bool(hits)
        alerts += len(hits)
    per_k = 1000.0 / steps if steps else float("nan")
    return {"runs": len(runs), "steps": steps, "runs_alarmed": alarmed, "alerts": alerts,
            "alarmed_per_1000": alarmed * per_k, "alerts_per_1000": alerts * per_k}


def write_config(config: MonitorConfig, out: str) -> None:
    """Write `config` as YAML (.yaml/.yml) or JSON, by temporary name and rename."""
    import json

    data = config.to_dict()
    data.pop("output_dir", None)
    folder = os.path.dirname(os.path.abspath(out))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".calibrate-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            if out.endswith((".yaml", ".yml")):
                require("yaml", f"--out {out}").safe_dump(data, fh, sort_keys=False)
            else:
                json.dump(data, fh, indent=1)
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise


def parse(argv):
    """The calibrate command's arguments."""
    parser = argparse.ArgumentParser(prog="mindspeed-proxy calibrate", description=(
        "Detector thresholds from healthy runs' monitor samples: each tested statistic's threshold is a quantile of "
        "the runs' maximum detector scores, for at most R runs with a false alarm per 1000 steps (docs/monitor.md)."))
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="healthy runs to calibrate on (tuning runs)")
    parser.add_argument("--false-alarms-per-1000-steps", type=float, required=True, metavar="R",
                        help="false-alarm budget: runs with a false alarm per 1000 healthy steps, all statistics")
    parser.add_argument("--out", required=True, help="calibrated MonitorConfig to write (.yaml/.yml or .json)")
    parser.add_argument("--mechanism-monitor-config", default=None, metavar="FILE",
                        help="base MonitorConfig (tested statistics, warm-up, persistence); default: the first run's")
    parser.add_argument("--forms", default="frozen", metavar="FORM[,FORM...]",
                        help=f"detector forms to calibrate, in order of preference ({', '.join(FORMS)}); "
                             "with --held-out the first that meets R there is written")
    parser.add_argument("--held-out", nargs="+", default=[], metavar="RUN_DIR",
                        help="healthy runs NOT calibrated on: each form's false alarms per 1000 steps on them")
    parser.add_argument("--tail", choices=TAILS, default="auto",
                        help="order: k-th largest run score (needs N+1 ≥ 1/q); gumbel: extrapolated fit; "
                             "auto: order where possible")
    return parser.parse_args(argv)


def prepare(args):
    """Validate and load everything before anything is computed or written (RunError/ValueError)."""
    rate = args.false_alarms_per_1000_steps
    if not rate > 0:
        raise ValueError(f"--false-alarms-per-1000-steps must be > 0, got {rate}")
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    bad = [f for f in forms if f not in FORMS]
    if bad or not forms:
        raise ValueError(f"--forms: unknown {bad or forms}; expected some of {list(FORMS)}")
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        raise ValueError(f"--out {args.out}: directory {folder} does not exist")
    runs = [healthy_run(p) for p in args.run_dirs]
    held = [healthy_run(p) for p in args.held_out]
    config = (MonitorConfig.from_file(args.mechanism_monitor_config) if args.mechanism_monitor_config
              else MonitorConfig.from_dict(runs[0].config))
    series = [run_series(r, config) for r in runs]
    stats = sorted({s for per_run in series for s in per_run})
    if not stats:
        raise RunError(f"{args.run_dirs[0]}: no healthy samples of any tested statistic "
                       f"(families {config.families}, detect_metrics {config.detect_metrics})")
    return rate, forms, runs, held, config, series, stats


def main(argv=None) -> int:
    """Entry point of `calibrate`: print per-statistic thresholds and held-out rates; exit 2 on bad input."""
    args = parse(argv)
    try:
        if args.out and args.out.endswith((".yaml", ".yml")):
            require("yaml", f"--out {args.out}")
        rate, forms, runs, held, config, series, stats = prepare(args)
        steps = sum(run_steps(r) for r in runs) / len(runs)
        q_total = rate * steps / 1000.0
        bases = base_configs(config, stats)
        candidates = {}
        for form in forms:
            skipped: dict = {}
            results = calibrate_statistics(series, bases, form, q_total, args.tail, skipped)
            meta = {"form": form, "false_alarms_per_1000_steps": rate, "tuning_runs": len(runs),
                    "steps_per_run": steps, "per_run_budget": q_total, "split": "equal over statistics",
                    "tuning_run_dirs": [os.path.basename(os.path.normpath(p)) for p in args.run_dirs],
                    "uncalibrated": skipped}
            candidates[form] = (results, calibrated_config(config, results, meta))
    except (RunError, ValueError, TypeError, CalibrationError, MissingExtra) as exc:
        return error("mindspeed-proxy calibrate", exc)
    print(f"{len(runs)} tuning runs, {steps:.0f} steps each on average; budget {rate:g} per 1000 steps = "
          f"{q_total:.4g} per run, split over {len(stats)} statistics")
    chosen = forms[0]
    held_rates = {}
    for form, (results, cfg) in candidates.items():
        for (family, metric), res in sorted(results.items()):
            guarantee = (f"P(alarm) ≤ {res['promised']:.3g} per run (k={res['k']} of N={res['runs']})"
                         if res["tail"] == "order" else f"Gumbel fit on N={res['runs']}: extrapolated, no guarantee")
            print(f"  [{form}] {family}/{metric}: {FORMS[form][1]} = {res['threshold']:.4g}; {guarantee}"
                  + (f"; {ZERO_THRESHOLD_MEANING}: tune on runs from as many starts (checkpoints, seeds) as the "
                     "new runs will have" if res["threshold"] == 0 else ""))
        for stat, reason in cfg.calibration["uncalibrated"].items():
            print(f"  [{form}] {stat}: NOT calibrated, keeps the base config's detector: {reason}")
        total = sum(res["promised"] for res in results.values())
        exact = all(res["tail"] == "order" for res in results.values())
        print(f"  [{form}] promise: P(a false alarm in a {steps:.0f}-step run) ≤ {total:.3g} = "
              f"{1000.0 * total / steps:.3g} per 1000 steps" + ("" if exact else " (partly extrapolated)")
              + (" (vacuous: ≥ 1, more tuning runs needed)" if total >= 1 else "")
              + (f"; {n} statistic(s) not calibrated are outside it" if (n := len(cfg.calibration["uncalibrated"]))
                 else ""))
        if held:
            held_rates[form] = false_alarms(held, cfg, set(stats))
            h = held_rates[form]
            print(f"  [{form}] held-out: {h['runs_alarmed']}/{h['runs']} runs alarmed in {h['steps']} steps = "
                  f"{h['alarmed_per_1000']:.3g} per 1000 steps ({h['alerts']} alerts, "
                  f"{h['alerts_per_1000']:.3g} per 1000 steps)")
    if held:
        meeting = [f for f in forms if held_rates[f]["alarmed_per_1000"] <= rate]
        chosen = meeting[0] if meeting else min(forms, key=lambda f: held_rates[f]["alarmed_per_1000"])
        print(f"form: {chosen} ({'first in --forms order that meets R on the held-out runs' if meeting else 'NO form meets R on the held-out runs; the one with the fewest'})")
    else:
        print(f"form: {chosen} (not validated: no --held-out runs)")
    results, cfg = candidates[chosen]
    if held:
        cfg.calibration["held_out"] = {"runs": len(held), "forms": held_rates}
    write_config(cfg, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
