"""Re-run the monitor's detectors over a recorded run: the alerts another detector config would have raised.

The monitor writes every sample's per-layer statistics to `monitor.jsonl`; the detectors only see those
numbers, so feeding them again, in step order, through a `DetectorBank` built from a `MonitorConfig`
reproduces the online alerts exactly for the run's own config and answers "what if" for any other
(thresholds, warm-up, EMA vs frozen baseline, tested metrics). Sampling intervals cannot be replayed:
only the recorded samples exist.
"""
from __future__ import annotations

from mindspeed_proxy.monitor.config import MonitorConfig
from mindspeed_proxy.monitor.detectors import FAMILIES as MONITOR_FAMILIES
from mindspeed_proxy.report.runs import Run, _float


def per_layer_metrics(family: str, layers: dict) -> dict:
    """A sample record's `layers` as {metric: {layer: value}}, with the monitor's metric names
    (rl records: layer key "all" is the monitor's layer None)."""
    out: dict = {}
    for key, rec in layers.items():
        layer = None if family == "rl" and key == "all" else int(key)
        if not isinstance(rec, dict):
            continue
        if family in ("router", "rl"):
            items = ((m, v) for m, v in rec.items() if m != "load")
        elif family == "update-spectral":
            items = ((f"{slot}/{stat}", v) for slot, stats in rec.items() for stat, v in stats.items())
        else:
            items = ((f"{term}/{stat}", v) for term, body in rec.items() if isinstance(body, dict)
                     for stat, v in body.get("mean", {}).items())
        for metric, value in items:
            out.setdefault(metric, {})[layer] = _float(value)
    return out


def replay_alerts(run: Run, config: MonitorConfig) -> list[dict]:
    """Alerts (as the monitor writes them) that `config`'s detectors raise over `run`'s recorded samples."""
    banks = config.detector_banks()
    events = sorted((s["step"], MONITOR_FAMILIES.index(family), family, s["layers"])
                    for family, samples in run.samples.items()
                    if family in config.families and family in MONITOR_FAMILIES for s in samples
                    if s.get("window_steps") is None)  # the monitor does not test a window a resume cut short
    alerts = []
    for step, _, family, layers in events:
        if step < config.detect_start:
            continue
        per_layer = per_layer_metrics(family, layers)
        series = config.detection_series(family, per_layer)
        alerts += [{"type": "alert", **a.to_dict()} for a in banks[family].update_many(step, series)]
    return alerts

