"""Load a run directory (`metrics.jsonl` + `mechanism_monitor/monitor.jsonl`) into plain series."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

FAMILIES = ("attention-spectral", "update-spectral", "router")
# the one metric per family that the aggregate curve and the heatmap show
HEADLINE = {"attention-spectral": "delta2/entropy", "update-spectral": "linear_qkv/entropy", "router": "entropy"}


class RunError(ValueError):
    """A run directory that cannot be read (missing, or without metrics.jsonl)."""


@dataclass
class Run:
    """One recorded run as plain lists and dicts."""

    path: Path
    args: dict = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    faults: list[dict] = field(default_factory=list)
    samples: dict[str, list[dict]] = field(default_factory=dict)  # family -> [{"step", "layers"}]
    alerts: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)

    def first_alert(self, family: str | None = None) -> dict | None:
        """The earliest alert (of `family`, if given), or None."""
        hits = [a for a in self.alerts if family is None or a.get("family") == family]
        return min(hits, key=lambda a: a["step"]) if hits else None


def _float(value) -> float:
    """JSON value to float; None/strings like "nan" become the float they name (NaN when unknown)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _read_jsonl(path: Path) -> list[dict]:
    """Records of a JSONL file, skipping blank or truncated lines (a run killed mid-write)."""
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def load_run(run_dir) -> Run:
    """Read `run_dir` into a Run; raises RunError when the directory or metrics.jsonl is missing."""
    path = Path(run_dir)
    if not path.is_dir():
        raise RunError(f"{path}: not a directory")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise RunError(f"{path}: no metrics.jsonl (not a run directory of examples/train_moe.py)")
    run = Run(path=path)
    by_step: dict[int, dict] = {}
    for rec in _read_jsonl(metrics):
        if rec.get("type") == "args":
            run.args = rec.get("args", {})
        elif rec.get("type") == "step" and "iteration" in rec:
            by_step[int(rec["iteration"])] = rec  # a resumed run repeats steps: the last record wins
    for step in sorted(by_step):
        run.steps.append(step)
        run.loss.append(_float(by_step[step].get("loss")))
        run.grad_norm.append(_float(by_step[step].get("grad_norm")))
    monitor = path / "mechanism_monitor" / "monitor.jsonl"
    if monitor.is_file():
        for rec in _read_jsonl(monitor):
            kind = rec.get("type")
            if kind == "config":
                run.config = rec.get("config", {})
            elif kind == "faults":
                run.faults = rec.get("faults", [])
            elif kind == "sample" and rec.get("family"):
                run.samples.setdefault(rec["family"], []).append({"step": rec["step"], "layers": rec["layers"]})
            elif kind == "alert":
                run.alerts.append(rec)
            elif kind == "monitor-error":
                run.errors.append(rec)
    for fam in run.samples.values():
        fam.sort(key=lambda s: s["step"])
    return run


def layer_label(layer) -> str:
    """How an alert's layer reads: "layer N", or "mean over layers" for a layer-mean series (layer None)."""
    return "mean over layers" if layer is None else f"layer {layer}"


def layer_value(family: str, layer_rec, metric: str) -> float:
    """One metric of one layer's sample record; `metric` is 'term/stat' or 'slot/stat' or 'stat'."""
    if not isinstance(layer_rec, dict):
        return math.nan
    if family == "attention-spectral":
        term, _, stat = metric.partition("/")
        return _float(layer_rec.get(term, {}).get("mean", {}).get(stat))
    if family == "update-spectral":
        slot, _, stat = metric.partition("/")
        return _float(layer_rec.get(slot, {}).get(stat))
    return _float(layer_rec.get(metric))


def headline_metric(run: Run, family: str) -> str:
    """The metric plotted for `family`: the default headline, else the first alerted metric of the family."""
    first = run.first_alert(family)
    if first and family != "update-spectral":
        return first["metric"]
    return HEADLINE.get(family, "entropy")


def family_matrix(run: Run, family: str, metric: str) -> tuple[list[int], list[str], list[list[float]]]:
    """(steps, layers, values[layer][step]) of `metric` across the family's samples."""
    samples = run.samples.get(family, [])
    layers = sorted({k for s in samples for k in s["layers"]}, key=lambda k: (len(k), k))
    steps = [s["step"] for s in samples]
    values = [[layer_value(family, s["layers"].get(layer), metric) for s in samples] for layer in layers]
    return steps, layers, values


def family_aggregate(run: Run, family: str, metric: str | None = None) -> tuple[list[int], list[float]]:
    """(steps, mean over layers) of the family's headline metric, NaNs ignored."""
    metric = metric or headline_metric(run, family)
    steps, _, values = family_matrix(run, family, metric)
    agg = []
    for j in range(len(steps)):
        col = [row[j] for row in values if math.isfinite(row[j])]
        agg.append(sum(col) / len(col) if col else math.nan)
    return steps, agg
