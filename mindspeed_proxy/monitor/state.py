"""The mechanism monitor as a Stateful part of a training checkpoint (detectors, disabled statistics, router load).

A checkpointer holds parts by name and calls `state_dict()` when it saves and `load_state_dict()` when it
loads (torchtitan's `states={...}` idea); the part copies nothing until then. The monitor's state is
rank-agnostic: every statistic it detects on is reduced so that each rank holds the same values (router
token sums over TP×CP, DP and PP; the ΔW / QK tables over TP, EP and PP, identical across DP replicas),
and the disabled set is agreed over the world; so the checkpoint keeps one copy (torch_dist: the common
state) and every rank restores it. Before this part, our trainer kept the state in a side file
`iter_*/mechanism_monitor_state.json`; `read_side_file` still reads it.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

KEY = "mechanism_monitor"  # the key of the part in the saved dict (legacy) or the common state (torch_dist)
VERSION = 1  # the monitor's state_dict() layout; a newer one is refused with a message
SIDE_FILE = "mechanism_monitor_state.json"  # where checkpoints written before the part kept the state


class StateVersionError(ValueError):
    """A saved monitor state of a layout this version cannot read (message: one line)."""


def _plain(obj):
    """Plain Python containers and numbers (no tensors, no aliases into live monitor state)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return obj


class MonitorPart:
    """Stateful view of a MechanismMonitor (or None: then it saves nothing and restores nothing)."""

    def __init__(self, monitor, allow_side_file: bool = True):
        self.monitor = monitor
        self.allow_side_file = allow_side_file
        self.restored_from: Optional[str] = None  # "checkpoint", "side file" or None after load

    def state_dict(self) -> Optional[dict]:
        """The monitor's state as plain containers, with its layout version; None without a monitor."""
        if self.monitor is None:
            return None
        state = _plain(self.monitor.state_dict())
        state["version"] = state.get("version", VERSION)
        return state

    def load_state_dict(self, state: Optional[dict], where: str = "checkpoint") -> None:
        """Restore a saved state (None: nothing saved, the monitor keeps its fresh state)."""
        if self.monitor is None or state is None:
            return
        check_version(state, where)
        self.monitor.load_state_dict(state)
        self.restored_from = where

    def fallback(self, folder: str) -> tuple:
        """(state, where) of an older checkpoint's side file in `folder` (None when there is none)."""
        state = read_side_file(folder) if self.allow_side_file and self.monitor is not None else None
        return state, os.path.join(folder, SIDE_FILE)


def check_version(state: dict, where: str) -> None:
    """Refuse a state whose layout version this code does not know (StateVersionError naming `where`)."""
    version = state.get("version", 1) if isinstance(state, dict) else None
    if not isinstance(version, (int, float)) or isinstance(version, bool) or not math.isfinite(version) \
            or int(version) != version or not 1 <= version <= VERSION:
        raise StateVersionError(f"{where}: mechanism monitor state version {version!r} is not supported "
                                f"(this mindspeed-proxy reads versions 1..{VERSION})")


def read_side_file(folder: str) -> Optional[dict]:
    """The state an older checkpoint kept in `folder/mechanism_monitor_state.json`, else None."""
    path = os.path.join(folder, SIDE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)
