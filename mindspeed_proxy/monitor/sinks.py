"""Where monitor results go: JSONL, CSV, and the run's own TensorBoard / wandb writers (objects passed in).

One tag scheme, `mechanism/{family}/{statistic}/{layer}`: layer is `layer_{i}` (global, 0-based), `mean|min|max`
over the layers of the sample, or `all` for a value of no single layer (the rl family's layer-free metrics);
statistic is `term/stat` (attention-spectral), `slot/stat` (update-spectral) or `stat`. Alerts are text
(`mechanism/alerts`) plus a marker scalar `mechanism/{family}/alerts/count` at each step that raised any.
"""
from __future__ import annotations

import csv
import json
import math
import os
from typing import Any, Iterable, Optional


def _finite(value: float) -> Optional[float]:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def scalar_tags(family: str, per_layer: dict[str, dict[int, float]]) -> dict[str, float]:
    """Flatten {metric: {layer: value}} into tag -> value, with mean/min/max over layers."""
    tags: dict[str, float] = {}
    for metric, layers in per_layer.items():
        values = [v for k, v in layers.items() if k is not None and _finite(v) is not None]
        for layer, value in layers.items():
            tags[f"mechanism/{family}/{metric}/{'all' if layer is None else f'layer_{layer}'}"] = value
        if values:
            tags[f"mechanism/{family}/{metric}/mean"] = sum(values) / len(values)
            tags[f"mechanism/{family}/{metric}/min"] = min(values)
            tags[f"mechanism/{family}/{metric}/max"] = max(values)
    return tags


class JsonlSink:
    """One JSON object per line: sample records and alert records, flushed each write."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self._fh = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (NaN/Inf become null, JSON has no such numbers)."""
        self._fh.write(json.dumps(_scrub(record), allow_nan=False, default=str) + "\n")
        self._fh.flush()

    def scalars(self, step: int, tags: dict[str, float]) -> None:
        """JSONL keeps structured records only; scalars are not repeated here."""

    def close(self) -> None:
        """Close the file."""
        self._fh.close()


def _scrub(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _scrub(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_scrub(v) for v in obj]
    return obj


class CsvSink:
    """Long-format CSV: step, tag, value (one row per scalar)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        new = not os.path.exists(path)
        self._fh = open(path, "a", encoding="utf-8", newline="")
        self._writer = csv.writer(self._fh)
        if new:
            self._writer.writerow(["step", "tag", "value"])

    def write(self, record: dict[str, Any]) -> None:
        """Structured records are JSONL's; CSV carries scalars."""

    def scalars(self, step: int, tags: dict[str, float]) -> None:
        """Append one row per tag."""
        for tag, value in sorted(tags.items()):
            self._writer.writerow([step, tag, value])
        self._fh.flush()

    def close(self) -> None:
        """Close the file."""
        self._fh.close()


class WriterSink:
    """Adapter for a TensorBoard SummaryWriter (`add_scalar`) or a wandb run / module (`log`)."""

    def __init__(self, writer):
        self.writer = writer
        self._markers: dict[tuple, int] = {}  # (family, step) -> alerts so far

    def write(self, record: dict[str, Any]) -> None:
        """An alert becomes text (`mechanism/alerts`) and a marker `mechanism/{family}/alerts/count` at its step."""
        if record.get("type") != "alert":
            return
        step, family = int(record.get("step") or 0), record.get("family", "monitor")
        self._markers[(family, step)] = self._markers.get((family, step), 0) + 1  # written with the next scalars
        text = json.dumps(_scrub(record))
        if hasattr(self.writer, "add_text"):
            self.writer.add_text("mechanism/alerts", text, step)
        elif hasattr(self.writer, "log"):
            self.writer.log({"mechanism/alerts": text}, step=step)

    def _flush_markers(self) -> None:
        markers, self._markers = self._markers, {}
        for (family, step), count in sorted(markers.items(), key=lambda kv: kv[0][1]):
            self._log(step, {f"mechanism/{family}/alerts/count": count})

    def scalars(self, step: int, tags: dict[str, float]) -> None:
        """Log every tag at `step` (and the alert markers of the sample just written)."""
        self._flush_markers()
        self._log(step, {t: v for t, v in tags.items() if _finite(v) is not None})

    def _log(self, step: int, finite: dict) -> None:
        if hasattr(self.writer, "add_scalar"):
            for tag, value in finite.items():
                self.writer.add_scalar(tag, value, step)
        elif hasattr(self.writer, "log"):
            self.writer.log(finite, step=step)

    def close(self) -> None:
        """Write pending alert markers and flush (the writer's owner closes it)."""
        self._flush_markers()
        flush = getattr(self.writer, "flush", None)
        if callable(flush):
            flush()


WRITER_SINKS = ("tensorboard", "wandb")  # sinks that write to a writer object someone else owns


def writer_dir(writer) -> Optional[str]:
    """The absolute folder of a TensorBoard SummaryWriter (None for anything else)."""
    folder = getattr(writer, "log_dir", None) or (writer.get_logdir() if hasattr(writer, "get_logdir") else None)
    return os.path.abspath(folder) if isinstance(folder, str) else None


def build_sinks(kinds: Iterable[str], output_dir: str, tensorboard_writer=None, wandb_writer=None) -> list:
    """Sinks named in `kinds`; tensorboard/wandb only when the run has that writer (else nothing for them)."""
    sinks: list = []
    for kind in kinds:
        if kind == "jsonl":
            sinks.append(JsonlSink(os.path.join(output_dir, "monitor.jsonl")))
        elif kind == "csv":
            sinks.append(CsvSink(os.path.join(output_dir, "monitor.csv")))
        elif kind == "tensorboard" and tensorboard_writer is not None:
            sinks.append(WriterSink(tensorboard_writer))
        elif kind == "wandb" and wandb_writer is not None:
            sinks.append(WriterSink(wandb_writer))
    return sinks
