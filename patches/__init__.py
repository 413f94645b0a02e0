"""The only code that touches torch / megatron-core / MindSpeed internals (installed as `mindspeed_proxy.patches`).

`apply(config)` switches the mechanism monitor on for megatron-core training in this process: it
applies the registry rows of the `mechanism-monitor` feature (and `mla-local-attention`: MLA on the
local spec, patches/mla_local.py), or, when MindSpeed is importable,
registers them by dotted path with MindSpeed's patch manager: MindSpeed applies them with its own when
its adaptor is imported afterwards; when MindSpeed has applied its patches already, they are applied at
once through the manager, so MindSpeed's decorator stacking holds. The MindSpeed feature-list route is
`mindspeed_proxy.patches.mindspeed_feature`. It returns an `Applied` handle: `revert()` (or leaving a
`with patches.apply(...):` block) puts back every attribute it patched and forgets the monitor state.
"""
from __future__ import annotations

from typing import Any, Optional

from mindspeed_proxy.patches import watchdog
from mindspeed_proxy.patches.mindspeed_manager import mindspeed_has_applied, mindspeed_manager, register_with_mindspeed
from mindspeed_proxy.patches.registry import Applied, apply_feature
from mindspeed_proxy.patches.rl_capture import CAPTURE
from mindspeed_proxy.patches.runtime import RUNTIME

__all__ = ["apply", "active_monitor", "register_with_mindspeed", "Applied"]


class _RuntimeReset(Applied):
    """The part of an apply() handle that forgets what it configured: the monitor, its config, the faults."""

    def revert(self) -> list[str]:
        """Disarm the first-step check and reset the runtime (once)."""
        if not self.reverted:
            self.reverted = True
            watchdog.disarm()
            RUNTIME.reset()
            CAPTURE.__init__()
        return []


def _mindspeed_manager():
    """MindSpeed's patch manager when MindSpeed is importable, else None."""
    return mindspeed_manager()


def apply(config: Optional[Any] = None, enable_monitor: bool = True, faults=()) -> Applied:
    """Install the patches once; with `enable_monitor`, monitor every optimizer built afterwards.

    `config` is a MonitorConfig, a dict, a JSON/YAML path, or None for the defaults. `faults` are
    "NAME[:key=value,...]" strings or FaultSpec objects. Returns the Applied handle of the patched targets (a
    list; with MindSpeed, the dotted paths registered with its manager, which MindSpeed applies and removes).
    """
    from mindspeed_proxy.faults.spec import FaultSpec, parse_fault
    from mindspeed_proxy.monitor.config import MonitorConfig
    from mindspeed_proxy.patches import fault_patches, mla_local, monitor_patches

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
    mla_local.register_all()
    features = [monitor_patches.FEATURE, mla_local.FEATURE]
    if RUNTIME.faults:
        fault_patches.register_all()
        features.append(fault_patches.FEATURE)
        if any(f.name == "lowp-attention" for f in RUNTIME.faults):
            features.append(fault_patches.LOWP_FEATURE)
    manager = _mindspeed_manager()
    done = Applied(children=[_RuntimeReset()])
    for feature in features:
        if manager is not None:
            done.extend(register_with_mindspeed(manager, feature))
        else:
            done.add(apply_feature(feature))
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
