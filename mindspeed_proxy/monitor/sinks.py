"""Where monitor results go: JSONL (always), CSV, and TensorBoard / wandb writer objects passed in.

Tags follow `mechanism/{family}/{metric}/layer_{i}` plus per-family aggregates over layers
(`mechanism/{family}/{metric}/mean|min|max`).
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
        values = [v for v in layers.values() if _finite(v) is not None]
        for layer, value in layers.items():
            tags[f"mechanism/{family}/{metric}/layer_{layer}"] = value
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

    def write(self, record: dict[str, Any]) -> None:
        """Alerts become text on TensorBoard; wandb logs them as a dict."""
        if record.get("type") == "alert" and hasattr(self.writer, "add_text"):
            self.writer.add_text("mechanism/alerts", json.dumps(_scrub(record)), record.get("step", 0))

    def scalars(self, step: int, tags: dict[str, float]) -> None:
        """Log every tag at `step`."""
        finite = {t: v for t, v in tags.items() if _finite(v) is not None}
        if hasattr(self.writer, "add_scalar"):
            for tag, value in finite.items():
                self.writer.add_scalar(tag, value, step)
        elif hasattr(self.writer, "log"):
            self.writer.log(finite, step=step)

    def close(self) -> None:
        """Flush (the writer's owner closes it)."""
        flush = getattr(self.writer, "flush", None)
        if callable(flush):
            flush()


WRITER_SINKS = ("tensorboard", "wandb")  # sinks that write to a writer object someone else owns


def build_sinks(kinds: Iterable[str], output_dir: str, tensorboard_writer=None, wandb_writer=None) -> list:
    """Sinks named in `kinds`; tensorboard/wandb only when a writer object is given."""
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
