"""Load a run directory (`metrics.jsonl` + `mechanism_monitor/monitor.jsonl`), or a monitor output folder (its
`monitor.jsonl`, the loss from the TensorBoard event files it recorded), into plain series."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from mindspeed_proxy.monitor.run_log import FILE, TwoRunsError, numbered_records, one_run

FAMILIES = ("attention-spectral", "update-spectral", "router")
# the one metric per family that the aggregate curve and the heatmap show
HEADLINE = {"attention-spectral": "delta2/entropy", "update-spectral": "linear_qkv/entropy", "router": "entropy"}


class RunError(ValueError):
    """A run directory that cannot be read (missing, neither metrics.jsonl nor monitor.jsonl, two runs in one)."""


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
    tensorboard_dir: Optional[str] = None  # where the monitor's TensorBoard scalars went (its config record)
    loss_source: str = "metrics.jsonl"

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
    return [record for _, record in numbered_records(str(path))]


def monitor_file(run_dir: Path) -> Optional[Path]:
    """The monitor.jsonl of a run: `RUN/mechanism_monitor/` (our trainer's log dir) or `RUN/` itself (a monitor
    output folder, e.g. `--mechanism-monitor-output` of a Megatron-LM run); None when there is neither."""
    for candidate in (run_dir / "mechanism_monitor" / FILE, run_dir / FILE):
        if candidate.is_file():
            return candidate
    return None


def load_run(run_dir) -> Run:
    """Read `run_dir` (our trainer's log dir, or a monitor output folder) into a Run; RunError when it is neither,
    or when its monitor.jsonl holds two runs (naming the line where the second starts)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise RunError(f"{path}: not a directory")
    metrics, monitor = path / "metrics.jsonl", monitor_file(path)
    if not metrics.is_file() and monitor is None:
        raise RunError(f"{path}: no metrics.jsonl and no monitor.jsonl (neither a run directory of "
                       "examples/train_moe.py nor a mechanism monitor output folder)")
    run = Run(path=path)
    if metrics.is_file():
        by_step: dict[int, dict] = {}
        for rec in _read_jsonl(metrics):
            if rec.get("type") == "args":
                run.args = rec.get("args", {})
            elif rec.get("type") == "step" and "iteration" in rec:
                by_step[int(rec["iteration"])] = rec  # a resumed run repeats steps: the last record wins
        _set_steps(run, {s: r.get("loss") for s, r in by_step.items()},
                   {s: r.get("grad_norm") for s, r in by_step.items()})
    if monitor is not None:
        try:
            records = one_run(numbered_records(str(monitor)), str(monitor))
        except TwoRunsError as exc:
            raise RunError(str(exc)) from None
        for rec in records:
            kind = rec.get("type")
            if kind == "config":
                run.config = rec.get("config", {})
                run.tensorboard_dir = rec.get("tensorboard_dir")
            elif kind == "faults":
                run.faults = rec.get("faults", [])
            elif kind == "sample" and rec.get("family"):
                sample = {"step": rec["step"], "layers": rec["layers"]}
                if rec.get("window_steps") is not None:  # a router window a resume cut short: not tested
                    sample["window_steps"] = rec["window_steps"]
                run.samples.setdefault(rec["family"], []).append(sample)
            elif kind == "alert":
                run.alerts.append(rec)
            elif kind == "monitor-error":
                run.errors.append(rec)
    if not metrics.is_file():
        _loss_from_tensorboard(run)
    for fam in run.samples.values():
        fam.sort(key=lambda s: s["step"])
    return run


def _set_steps(run: Run, loss: dict, grad_norm: dict) -> None:
    for step in sorted(loss):
        run.steps.append(step)
        run.loss.append(_float(loss[step]))
        run.grad_norm.append(_float(grad_norm.get(step)))


def _loss_from_tensorboard(run: Run) -> None:
    """A monitor folder's loss: the event files the monitor wrote its scalars to (its config record says where)."""
    from mindspeed_proxy.report.event_file import has_event_files, read_loss

    if not has_event_files(run.tensorboard_dir):
        run.loss_source = "none (no metrics.jsonl, no TensorBoard event file recorded)"
        return
    try:
        tag, loss, grad = read_loss(run.tensorboard_dir)
    except ImportError:
        run.loss_source = f"none ({run.tensorboard_dir} not read: needs the tensorboard package)"
        return
    _set_steps(run, loss, grad)
    run.loss_source = f"TensorBoard {run.tensorboard_dir} ({tag!r})" if tag else \
        f"none ({run.tensorboard_dir} has no loss tag)"


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
