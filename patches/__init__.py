"""The only code that touches torch / megatron-core / MindSpeed internals (installed as `mindspeed_proxy.patches`).

`apply(config)` switches the mechanism monitor on for megatron-core training in this process: it
applies the registry rows of the `mechanism-monitor` feature (or, when MindSpeed is importable,
registers them by dotted path with MindSpeed's patch manager, which applies them with its own).
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Optional

from mindspeed_proxy.patches.registry import apply_feature, table
from mindspeed_proxy.patches.runtime import RUNTIME


def _mindspeed_manager():
    if importlib.util.find_spec("mindspeed") is None:
        return None
    try:
        patch_utils = importlib.import_module("mindspeed.patch_utils")
    except ImportError:
        return None
    return getattr(patch_utils, "MindSpeedPatchesManager", None) or getattr(patch_utils, "PatchesManager", None)


def register_with_mindspeed(manager, feature: str) -> list[str]:
    """Register every row of `feature` with MindSpeed's manager by dotted path; return the paths."""
    done = []
    for patch in table():
        if patch.feature != feature:
            continue
        module, _, attr = patch.target.partition(":")
        dotted = f"{module}.{attr}"
        if patch.optional and importlib.util.find_spec(module.split(".")[0]) is None:
            continue
        # MindSpeed stacks a function whose name ends in "wrapper" as a decorator of the original
        manager.register_patch(dotted, patch.build)
        done.append(dotted)
    return done


def apply(config: Optional[Any] = None, enable_monitor: bool = True, faults=()) -> list[str]:
    """Install the patches once; with `enable_monitor`, monitor every optimizer built afterwards.

    `config` is a MonitorConfig, a dict, a JSON/YAML path, or None for the defaults. `faults` are
    "NAME[:key=value,...]" strings or FaultSpec objects. Returns the patched targets (or the dotted
    paths registered with MindSpeed).
    """
    from mindspeed_proxy.faults.spec import FaultSpec, parse_fault
    from mindspeed_proxy.monitor.config import MonitorConfig
    from mindspeed_proxy.patches import fault_patches, monitor_patches

    RUNTIME.faults = [f if isinstance(f, FaultSpec) else parse_fault(f) for f in faults]

    if enable_monitor:
        if config is None:
            config = MonitorConfig()
        elif isinstance(config, str):
            config = MonitorConfig.from_file(config)
        elif isinstance(config, dict):
            config = MonitorConfig.from_dict(config)
        RUNTIME.config = config
    monitor_patches.register_all()
    features = [monitor_patches.FEATURE]
    if RUNTIME.faults:
        fault_patches.register_all()
        features.append(fault_patches.FEATURE)
        if any(f.name == "lowp-attention" for f in RUNTIME.faults):
            features.append(fault_patches.LOWP_FEATURE)
    manager = _mindspeed_manager()
    done = []
    for feature in features:
        done += register_with_mindspeed(manager, feature) if manager is not None else apply_feature(feature)
    return done


def active_monitor():
    """The MechanismMonitor created by the patched get_megatron_optimizer, or None."""
    return RUNTIME.monitor
