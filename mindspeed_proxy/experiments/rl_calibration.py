"""The RL matrix's held-out protocol: thresholds from `calibrate` on tuning seeds' healthy runs, alerts of every
held-out run by replaying its recorded samples with them (the runs' online alerts are not the reported ones)."""
from __future__ import annotations

import os

from mindspeed_proxy.monitor.calibration import CalibrationError, calibrate_statistics
from mindspeed_proxy.monitor.config import MonitorConfig
from mindspeed_proxy.report.calibrate_cli import (base_configs, calibrated_config, healthy_run, run_series,
                                                  run_steps, write_config)
from mindspeed_proxy.report.replay import replay_alerts
from mindspeed_proxy.report.runs import load_run


def calibrate_runs(run_dirs: list, base_path, rate: float, form: str, tail: str = "auto") -> tuple:
    """`calibrate`'s thresholds on `run_dirs` (healthy) for R = `rate` per 1000 steps in detector form `form`.

    As `mindspeed-proxy calibrate`: a statistic whose tuning scores give no threshold (all equal: a Gumbel fit
    has no spread) keeps the base config's detector and is listed in `uncalibrated`. Returns (MonitorConfig, {statistic: result}, {statistic: reason})."""
    runs = [healthy_run(str(p)) for p in run_dirs]
    config = MonitorConfig.from_file(str(base_path))
    series = [run_series(r, config) for r in runs]
    stats = sorted({s for per_run in series for s in per_run})
    if not stats:
        raise CalibrationError(f"{run_dirs[0]}: no healthy samples of any tested statistic")
    steps = sum(run_steps(r) for r in runs) / len(runs)
    q_total = rate * steps / 1000.0
    bases = base_configs(config, stats)
    uncalibrated: dict = {}
    results = calibrate_statistics(series, bases, form, q_total, tail, uncalibrated)
    meta = {"form": form, "false_alarms_per_1000_steps": rate, "tuning_runs": len(runs), "steps_per_run": steps,
            "per_run_budget": q_total, "split": "equal over statistics",
            "tuning_run_dirs": [os.path.relpath(str(p), os.path.dirname(str(run_dirs[0]))) for p in run_dirs],
            "uncalibrated": uncalibrated}
    return calibrated_config(config, results, meta), results, uncalibrated


def write_calibration(out, run_dirs: list, base_path, rate: float, form: str) -> dict:
    """Calibrate on `run_dirs` and write the config to `out`; a summary for the page ({} keys on failure: error)."""
    try:
        config, results, uncalibrated = calibrate_runs(run_dirs, base_path, rate, form)
    except CalibrationError as exc:
        return {"error": str(exc), "path": str(out), "runs": len(run_dirs)}
    write_config(config, str(out))
    return {"path": str(out), "runs": len(run_dirs), "uncalibrated": uncalibrated,
            "thresholds": {"/".join(s): {"threshold": r["threshold"], "tail": r["tail"], "promised": r["promised"]}
                           for s, r in sorted(results.items())}}


def replayed_alerts(run_dir, config_path) -> list[dict]:
    """The alerts `config_path`'s detectors raise over `run_dir`'s recorded samples ([] without samples)."""
    run = load_run(str(run_dir))
    if not run.samples:
        return []
    return replay_alerts(run, MonitorConfig.from_file(str(config_path)))
