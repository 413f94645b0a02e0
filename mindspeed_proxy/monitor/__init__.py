"""Monitor math: spectral statistics, router statistics and change detectors (torch only, no Megatron imports)."""
from mindspeed_proxy.monitor.detectors import (
    METRIC_DIRECTIONS,
    Alert,
    DetectorBank,
    DetectorConfig,
    SeriesDetector,
)
from mindspeed_proxy.monitor.router import RouterStats, router_weight_stats, winner_persistence
from mindspeed_proxy.monitor.spectral import (
    lowrank_product_singular_values,
    qk_increment_singular_values,
    qk_increment_spectra,
    spectral_stats,
    update_singular_values,
)

__all__ = [
    "Alert",
    "DetectorBank",
    "DetectorConfig",
    "METRIC_DIRECTIONS",
    "RouterStats",
    "SeriesDetector",
    "lowrank_product_singular_values",
    "qk_increment_singular_values",
    "qk_increment_spectra",
    "router_weight_stats",
    "spectral_stats",
    "update_singular_values",
    "winner_persistence",
]

from mindspeed_proxy.monitor.config import MonitorConfig  # noqa: E402
from mindspeed_proxy.monitor.monitor import MechanismMonitor  # noqa: E402

__all__ += ["MechanismMonitor", "MonitorConfig"]
