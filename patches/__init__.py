"""The only code that touches torch / megatron-core / MindSpeed internals (installed as `mindspeed_proxy.patches`).

`apply(config)` switches the mechanism monitor on for megatron-core training in this process: it
applies the registry rows of the `mechanism-monitor` feature, or, when MindSpeed is importable,
registers them by dotted path with MindSpeed's patch manager: MindSpeed applies them with its own when
its adaptor is imported afterwards; when MindSpeed has applied its patches already, they are applied at
once through the manager, so MindSpeed's decorator stacking holds. The MindSpeed feature-list route is
`mindspeed_proxy.patches.mindspeed_feature`.
"""
from __future__ import annotations

from typing import Any, Optional

from mindspeed_proxy.patches import watchdog
from mindspeed_proxy.patches.mindspeed_manager import mindspeed_has_applied, mindspeed_manager, register_with_mindspeed
from mindspeed_proxy.patches.registry import apply_feature
from mindspeed_proxy.patches.runtime import RUNTIME

__all__ = ["apply", "active_monitor", "register_with_mindspeed"]


def _mindspeed_manager():
    """MindSpeed's patch manager when MindSpeed is importable, else None."""
    return mindspeed_manager()


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
    if manager is not None:
        RUNTIME.mindspeed_manager = manager
        if mindspeed_has_applied(manager):
            manager.apply_patches()  # re-applies only the patches our rows joined, MindSpeed's wrappers first
    if enable_monitor:
        watchdog.arm()
    return done


def active_monitor():
    """The MechanismMonitor created by the patched get_megatron_optimizer, or None."""
    return RUNTIME.monitor
