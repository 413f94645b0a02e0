"""One-sided change detectors against each series' own warm-up baseline, and a keyed bank of them."""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

METHODS = ("median_mad", "ema")
DIRECTIONS = ("down", "up")
FAMILIES = ("attention-spectral", "update-spectral", "router", "rl")
MAD_TO_SIGMA = 1.4826  # MAD of a Gaussian × this = its standard deviation

METRIC_DIRECTIONS: dict[str, str] = {
    "entropy": "down",
    "normalized_entropy": "down",
    "effective_rank": "down",
    "stable_rank": "down",
    "load_entropy": "down",
    "normalized_load_entropy": "down",
    "similarity": "up",
    "top1_energy": "up",
    "max_over_mean": "up",
    "dead_experts": "up",
    "overload": "up",
    "winner_persistence": "up",
    "margin": "up",
    "topk_match": "down",
    "jaccard": "down",
    "any_layer_mismatch": "up",
    "mismatch_k3_kl": "up",
    "mismatch_abs_logp_mean": "up",
    "load_drift": "up",
    "frobenius": "up",
    "gap_abs_mean": "up",
}

MECHANISMS: dict[str, tuple[str, str]] = {
    "attention-spectral": (
        "low-precision attention backward: coherent low-rank QK update",
        "low-precision attention backward suspected: try FP32 accumulation of P·V / the FA max-shift fix",
    ),
    "update-spectral": (
        "coherent low-rank weight update",
        "coherent low-rank update suspected (biased low-precision accumulation in the backward): try FP32 "
        "accumulation of P·V / the FA max-shift fix, check BF16 kernels and the optimizer's precision",
    ),
    "router": (
        "routing collapse (stable-winner feedback)",
        "routing collapse: lower LR, raise global batch, fp32 router, z-loss or expert bias",
    ),
    "rl": ("RL training health", "see the metric's mechanism"),
}
ROUTING_MISMATCH = (
    "routing-mismatch: the training pass routes tokens to other experts than the rollout did",
    "enable routing replay (R3: --rl-routing-replay r3); check the sampler's precision and router dtype",
)
# mechanisms of single metrics, where one family watches several mechanisms
METRIC_MECHANISMS: dict[tuple[str, str], tuple[str, str]] = {
    ("rl", "topk_match"): ROUTING_MISMATCH,
    ("rl", "jaccard"): ROUTING_MISMATCH,
    ("rl", "any_layer_mismatch"): ROUTING_MISMATCH,
    ("rl", "mismatch_k3_kl"): ROUTING_MISMATCH,
    ("rl", "mismatch_abs_logp_mean"): ROUTING_MISMATCH,
    ("rl", "entropy"): (
        "entropy-collapse: the policy's token entropy fell far below its baseline",
        "raise --grpo-entropy-term-weight or --grpo-clamp-eps-upper (clip-higher), lower the LR, check rewards",
    ),
    ("update-spectral", "frobenius"): (
        "update-magnitude jump: ‖ΔW‖_F far above its baseline",
        "the weights move far faster than before: check the LR schedule (LR spike), loss scaling, grad clipping",
    ),
    ("rl", "load_drift"): (
        "expert-load drift: the experts' token shares moved away from the first RL step's",
        "routing collapse under RL: lower LR, expert bias / aux loss, replay routing (R3)",
    ),
}
# the dominant term of the train–rollout logprob-gap decomposition (rl/gap.py) names the cause of a mismatch alert
GAP_CAUSES: dict[str, tuple[str, str]] = {
    "flip": ("routing-mismatch: expert flips",
             "replay the rollout's experts in the training passes (R3: --rl-routing-replay r3)"),
    "weights": ("routing-mismatch: routing weights",
                "replay the rollout's routing probabilities as well as its experts (R3 replays the experts only)"),
    "other": ("numeric mismatch",
              "check the rollout's vs the trainer's precision and kernels (bf16 sampler, attention / GEMM kernels) "
              "and that the rollout ran the trainer's current weights"),
}
NON_FINITE = ("non-finite statistic", "non-finite value: check for overflow (loss scale, grad clipping, BF16 ops)")


@dataclass
class DetectorConfig:
    """Thresholds of one series detector; every field is a config key.

    The defaults keep false alarms on stationary iid Gaussian noise below 1e-5 per sample (tested),
    with or without the CUSUM; real metric series are autocorrelated, so tune on healthy runs.
    """

    warmup: int = 50  # samples forming the baseline before any threshold alert
    method: str = "median_mad"  # "median_mad": frozen robust baseline; "ema": adapts outside excursions
    z_threshold: float = 4.0
    persistence: int = 3  # consecutive samples beyond z_threshold needed for an alert
    direction: str = "down"  # "down": alert on drops; "up": on rises
    ema_alpha: float = 0.02
    cusum: bool = False  # also run a one-sided CUSUM on z
    cusum_k: float = 1.0  # allowance in z units: only z above it accumulates
    cusum_h: float = 10.0
    min_scale: float = 1e-8  # absolute floor on the baseline scale (MAD = 0 on constant series)
    min_rel_scale: float = 0.0  # floor on the scale relative to |baseline|: z = 1 needs a change of this fraction

    def __post_init__(self):
        for f in dataclasses.fields(self):  # YAML 1.1 reads "1.0e9" as a string: coerce, or name the key
            if f.type in ("int", "float", "bool"):
                value = getattr(self, f.name)
                try:
                    cast = {"int": int, "float": float, "bool": bool}[f.type](value)
                except (TypeError, ValueError):
                    raise ValueError(f"detector {f.name}: expected a number, got {value!r}") from None
                if f.type == "int" and cast != value or f.type == "bool" and not isinstance(value, (bool, int)):
                    raise ValueError(f"detector {f.name}: expected {f.type}, got {value!r}")
                setattr(self, f.name, cast)
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if self.min_rel_scale < 0 or self.min_scale < 0:
            raise ValueError("min_scale and min_rel_scale must be ≥ 0")
        if self.warmup < 2 or self.persistence < 1:
            raise ValueError("warmup must be ≥ 2 and persistence ≥ 1")


@dataclass
class Alert:
    """One detection, with the series it came from and the mechanism it points to."""

    step: int
    family: str
    metric: str
    layer: Optional[int]
    head_or_expert: Optional[int]
    value: float
    baseline: Optional[float]
    z: Optional[float]
    kind: str  # "threshold", "cusum" or "non-finite"
    mechanism: str = ""
    mitigation: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (for JSON sinks)."""
        return dataclasses.asdict(self)


class SeriesDetector:
    """Warm-up baseline, then one-sided z in the configured direction; alerts once per excursion."""

    def __init__(self, config: Optional[DetectorConfig] = None):
        self.config = config or DetectorConfig()
        self._warm: list[float] = []
        self.baseline: Optional[float] = None
        self.scale: Optional[float] = None
        self._var = 0.0
        self._run = 0
        self._run_armed = True
        self._cusum = 0.0
        self._cusum_armed = True
        self._finite_armed = True
        self.samples = 0

    @property
    def ready(self) -> bool:
        """Whether the warm-up is over and a baseline exists."""
        return self.baseline is not None

    def update(self, step: int, value: float) -> Optional[dict[str, Any]]:
        """Feed one sample; return an alert dict (step, value, baseline, z, kind, direction) or None."""
        value = float(value)
        self.samples += 1
        if not math.isfinite(value):  # alerts at once; again only after a finite sample
            alert = self._alert(step, value, None, "non-finite") if self._finite_armed else None
            self._finite_armed = False
            return alert
        self._finite_armed = True
        cfg = self.config
        if self.baseline is None:
            self._warm.append(value)
            if len(self._warm) >= cfg.warmup:
                self._fit_baseline()
            return None
        z = self._z(value)
        alert = None
        if z > cfg.z_threshold:
            self._run += 1
            if self._run >= cfg.persistence and self._run_armed:
                self._run_armed = False
                alert = self._alert(step, value, z, "threshold")
        else:
            self._run = 0
            self._run_armed = True
            if cfg.method == "ema":
                self._ema_update(value)
        if cfg.cusum:
            self._cusum = max(0.0, self._cusum + z - cfg.cusum_k)
            if self._cusum == 0.0:
                self._cusum_armed = True
            elif self._cusum > cfg.cusum_h and self._cusum_armed:
                self._cusum_armed = False
                alert = alert or self._alert(step, value, z, "cusum")
        return alert

    def _z(self, value: float) -> float:
        delta = value - self.baseline
        return (delta if self.config.direction == "up" else -delta) / self.scale

    def _fit_baseline(self) -> None:
        cfg = self.config
        if cfg.method == "median_mad":
            center = statistics.median(self._warm)
            spread = MAD_TO_SIGMA * statistics.median(abs(x - center) for x in self._warm)
            self._var = spread * spread
        else:
            center = statistics.fmean(self._warm)
            self._var = statistics.pvariance(self._warm, center)
        self.baseline = center
        self._set_scale()
        self._warm = []

    def _ema_update(self, value: float) -> None:
        alpha = self.config.ema_alpha
        diff = value - self.baseline
        self.baseline += alpha * diff
        self._var = (1.0 - alpha) * (self._var + alpha * diff * diff)
        self._set_scale()

    def _set_scale(self) -> None:
        cfg = self.config
        self.scale = max(math.sqrt(self._var), cfg.min_scale, cfg.min_rel_scale * abs(self.baseline))

    def _alert(self, step, value, z, kind) -> dict[str, Any]:
        return {"step": int(step), "value": value, "baseline": self.baseline, "z": z, "kind": kind,
                "direction": self.config.direction}

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state; load_state_dict of it continues exactly where this detector is."""
        state = {k: v for k, v in vars(self).items() if k != "config"}
        state["config"] = dataclasses.asdict(self.config)
        state["_warm"] = list(self._warm)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state produced by state_dict()."""
        state = dict(state)
        self.config = DetectorConfig(**state.pop("config"))
        for key, value in state.items():
            setattr(self, key, list(value) if key == "_warm" else value)


SeriesKey = tuple  # (family, metric, layer, head_or_expert); layer / head_or_expert may be None


@dataclass
class DetectorBank:
    """Detectors keyed by (family, metric, layer, head_or_expert), created lazily with the metric's direction.

    The direction comes from `directions` by exact metric name, else by its last '/'-separated
    part (so "delta2/entropy" is "down"); an unknown metric raises. `metric_configs` overrides the
    default config per metric (direction still from `directions`).
    """

    config: DetectorConfig = field(default_factory=DetectorConfig)
    metric_configs: dict[str, DetectorConfig] = field(default_factory=dict)
    directions: dict[str, str] = field(default_factory=lambda: dict(METRIC_DIRECTIONS))
    detectors: dict[SeriesKey, SeriesDetector] = field(default_factory=dict)

    def direction(self, metric: str) -> str:
        """Mechanism direction of `metric` ("down" or "up")."""
        if metric in self.directions:
            return self.directions[metric]
        tail = metric.rsplit("/", 1)[-1]
        if tail in self.directions:
            return self.directions[tail]
        raise KeyError(f"no detection direction known for metric {metric!r}; add it to `directions`")

    def detector(self, key: SeriesKey) -> SeriesDetector:
        """The detector of series `key`, created on first use."""
        det = self.detectors.get(key)
        if det is None:
            family, metric = key[0], key[1]
            if family not in FAMILIES:
                raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
            base = self.metric_configs.get(metric, self.config)
            det = SeriesDetector(dataclasses.replace(base, direction=self.direction(metric)))
            self.detectors[key] = det
        return det

    def update(self, key: SeriesKey, step: int, value: float) -> Optional[Alert]:
        """Feed one sample of series `key`; return an Alert or None."""
        family, metric, layer, index = (tuple(key) + (None, None))[:4]
        raw = self.detector(tuple(key)).update(step, value)
        if raw is None:
            return None
        mechanism, mitigation = NON_FINITE if raw["kind"] == "non-finite" else METRIC_MECHANISMS.get(
            (family, metric.rsplit("/", 1)[-1])) or MECHANISMS[family]
        return Alert(step=raw["step"], family=family, metric=metric, layer=layer, head_or_expert=index,
                     value=raw["value"], baseline=raw["baseline"], z=raw["z"], kind=raw["kind"],
                     mechanism=mechanism, mitigation=mitigation)

    def update_many(self, step: int, values: Mapping[SeriesKey, Any]) -> list[Alert]:
        """Feed one sample per series; tensor values are moved to the host in a single transfer."""
        keys = list(values)
        floats = _to_floats([values[k] for k in keys])
        alerts = [self.update(k, step, v) for k, v in zip(keys, floats)]
        return [a for a in alerts if a is not None]

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state of every detector (keys stored as lists)."""
        return {
            "config": dataclasses.asdict(self.config),
            "metric_configs": {m: dataclasses.asdict(c) for m, c in self.metric_configs.items()},
            "directions": dict(self.directions),
            "detectors": [[list(k), d.state_dict()] for k, d in self.detectors.items()],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state produced by state_dict() (also after a JSON round trip)."""
        self.config = DetectorConfig(**state["config"])
        self.metric_configs = {m: DetectorConfig(**c) for m, c in state["metric_configs"].items()}
        self.directions = dict(state["directions"])
        self.detectors = {}
        for key, det_state in state["detectors"]:
            det = SeriesDetector()
            det.load_state_dict(det_state)
            self.detectors[tuple(key)] = det


def _to_floats(values: list) -> list[float]:
    out = list(values)
    groups: dict[tuple, list[int]] = {}
    for i, v in enumerate(values):
        if hasattr(v, "detach"):
            groups.setdefault((v.device, v.dtype), []).append(i)
    if groups:
        import torch

        for idx in groups.values():
            for i, v in zip(idx, torch.stack([values[i].detach().reshape(()) for i in idx]).tolist()):
                out[i] = v
    return [float(v) for v in out]
