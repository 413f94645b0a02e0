"""The mechanism monitor and the fault injectors as MindSpeed features (`mindspeed.features_manager`).

Add them to the feature list MindSpeed, MindSpeed-LLM or MindSpeed-RL builds (docs/monitor.md):
`MindSpeedFeaturesManager` then registers our flags with its parser (`register_args`), checks them with
its own (`validate_args`, also called with a TransformerConfig, which carries none of our flags) and
registers our rows with its patch manager (`register_patches`), each row's version gate first; MindSpeed
applies them together with its own patches. A feature built with a `config` (or `faults`) is on without
any flag, for hosts whose command line is generated (MindSpeed-RL's YAML accepts only keys it knows).
Needs MindSpeed (the base class comes from `mindspeed.features_manager.feature`).
"""
from __future__ import annotations

from typing import Any, Optional

from mindspeed.features_manager.feature import MindSpeedFeature

from mindspeed_proxy.patches import watchdog
from mindspeed_proxy.patches.mindspeed_manager import register_with_mindspeed
from mindspeed_proxy.patches.runtime import RUNTIME


class MechanismMonitorFeature(MindSpeedFeature):
    """`--enable-mechanism-monitor` and its companions; the monitor's rows in MindSpeed's patch manager."""

    def __init__(self, config: Optional[Any] = None):
        super().__init__("enable-mechanism-monitor")
        self.config = None if config is None else _monitor_config(config)

    def is_need_apply(self, args) -> bool:
        """On with the flag or a config; independent of --optimization-level (the monitor only observes)."""
        return self.config is not None or bool(getattr(args, self.feature_name, False))

    def register_args(self, parser) -> None:
        """Our flags on MindSpeed's / Megatron-LM's parser (kept once if another route added them)."""
        from mindspeed_proxy.monitor.arguments import add_monitor_arguments

        add_monitor_arguments(parser)

    def validate_args(self, args) -> None:
        """The monitor config the flags describe must build (ValueError names the flag)."""
        from mindspeed_proxy.monitor.arguments import monitor_config_from_args, monitor_flags_from

        if getattr(args, self.feature_name, False):
            monitor_config_from_args(monitor_flags_from(args))

    def register_patches(self, patch_manager, args) -> None:
        """Configure the monitor and register its rows (without the parser rows) with `patch_manager`."""
        from mindspeed_proxy.monitor.arguments import monitor_config_from_args, monitor_flags_from
        from mindspeed_proxy.patches import monitor_patches

        RUNTIME.config = self.config if self.config is not None else monitor_config_from_args(monitor_flags_from(args))
        RUNTIME.mindspeed_manager = patch_manager
        monitor_patches.register_all()
        register_with_mindspeed(patch_manager, monitor_patches.FEATURE, arguments=False)
        watchdog.arm()


class FaultInjectionFeature(MindSpeedFeature):
    """`--inject-fault NAME[:key=value,...]` (repeatable); the injectors' rows in MindSpeed's patch manager."""

    def __init__(self, faults=()):
        super().__init__("inject-fault")
        self.faults = list(faults)

    def is_need_apply(self, args) -> bool:
        """On when a fault is requested by flag or constructor."""
        return bool(self.faults or getattr(args, self.feature_name, None))

    def register_args(self, parser) -> None:
        """--inject-fault (it belongs to the monitor's flag group)."""
        from mindspeed_proxy.monitor.arguments import add_monitor_arguments

        add_monitor_arguments(parser)

    def validate_args(self, args) -> None:
        """Every requested fault must parse (ValueError names it and the known names/keys)."""
        for text in _fault_texts(getattr(args, self.feature_name, None)):
            _parse(text)

    def register_patches(self, patch_manager, args) -> None:
        """Arm the injectors and register their rows, with the optimizer row that counts steps."""
        from mindspeed_proxy.patches import fault_patches, monitor_patches

        RUNTIME.faults = [_parse(f) for f in self.faults or _fault_texts(getattr(args, self.feature_name, None))]
        RUNTIME.mindspeed_manager = patch_manager
        monitor_patches.register_all()
        fault_patches.register_all()
        features = [monitor_patches.FEATURE, fault_patches.FEATURE]
        if any(f.name == "lowp-attention" for f in RUNTIME.faults):
            features.append(fault_patches.LOWP_FEATURE)
        for feature in features:
            register_with_mindspeed(patch_manager, feature, arguments=False)


def proxy_features(config: Optional[Any] = None, faults=()) -> list:
    """[MechanismMonitorFeature, FaultInjectionFeature]: what to add to a MindSpeed feature list."""
    return [MechanismMonitorFeature(config), FaultInjectionFeature(faults)]


def _monitor_config(config):
    from mindspeed_proxy.monitor.config import MonitorConfig

    if isinstance(config, MonitorConfig):
        return config
    return MonitorConfig.from_file(config) if isinstance(config, str) else MonitorConfig.from_dict(config)


def _fault_texts(value) -> list:
    # MindSpeed's pre-parse keeps an unknown repeated flag as one string; our parser gives a list
    if not value:
        return []
    return [value] if isinstance(value, str) else list(value)


def _parse(fault):
    from mindspeed_proxy.faults.spec import FaultSpec, parse_fault

    return fault if isinstance(fault, FaultSpec) else parse_fault(fault)
