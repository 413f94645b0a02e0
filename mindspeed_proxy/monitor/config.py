"""MonitorConfig: what the mechanism monitor samples, how often, its detector thresholds and its sinks."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from mindspeed_proxy.monitor.detectors import FAMILIES, DetectorConfig

STAT_NAMES = ("entropy", "normalized_entropy", "effective_rank", "stable_rank", "top1_energy", "frobenius")
ROUTER_TOKEN_METRICS = ("entropy", "normalized_entropy", "load_entropy", "max_over_mean", "dead_experts",
                        "overload", "margin", "winner_persistence")
ROUTER_WEIGHT_METRICS = ("similarity", "conditioning_ratio")
UPDATE_MATRICES = ("linear_qkv", "linear_proj", "router", "experts", "dense_mlp")
SINKS = ("jsonl", "tensorboard", "wandb")  # the default sinks; csv is the other one
DEFAULT_DELTA = 100  # δ when none is given: min(DEFAULT_DELTA, interval)


@dataclass
class MonitorConfig:
    """Every knob of the mechanism monitor (JSON/YAML loadable with `from_file`)."""

    interval: int = 100  # spectral sample every `interval` optimizer steps
    delta: Optional[int] = None  # δ: ΔW = W_t − W_{t−δ}; 1 ≤ δ ≤ interval; None: min(100, interval)
    router_interval: int = 10  # router token statistics accumulate over N steps, then reduce/log/test
    layers: Optional[list[int]] = None  # 0-based global layer indices; None = all
    heads: Optional[list[int]] = None  # global query-head indices for the QK monitor; None = all
    qk_terms: list[str] = field(default_factory=lambda: ["delta2"])
    # samples in a row that reuse the previous sample's Gram of the snapshot's q/k blocks (δ = interval only:
    # the snapshot is then the weights just sampled) before one is recomputed exactly; 0 always recomputes
    qk_gram_reuse: int = 16
    update_matrices: list[str] = field(default_factory=lambda: list(UPDATE_MATRICES))
    experts_per_layer: int = 2  # ΔW of this many experts per MoE layer, spread over global ids
    snapshot_on_cpu: bool = False
    families: list[str] = field(default_factory=lambda: ["attention-spectral", "update-spectral", "router", "rl"])
    detector: DetectorConfig = field(default_factory=lambda: DetectorConfig(warmup=10, persistence=2))
    router_detector: DetectorConfig = field(default_factory=lambda: DetectorConfig(warmup=50, persistence=5))
    # the RL loop's family (one sample per RL step): routing consistency and load drift per layer, entropy;
    # a healthy fp32 run repeats the rollout's routing exactly, so the floors set what counts as a change
    rl_detector: DetectorConfig = field(default_factory=lambda: DetectorConfig(
        warmup=5, persistence=2, z_threshold=4.0, min_scale=0.005, min_rel_scale=0.01))
    rl_metric_detectors: dict[str, dict] = field(default_factory=lambda: {
        "entropy": {"warmup": 5, "persistence": 3, "z_threshold": 3.2, "min_rel_scale": 0.3}})  # a 96% drop
    # per-statistic overrides of the family's detector, {family: {metric: {key: value}}}, e.g. the thresholds
    # `mindspeed-proxy calibrate` writes; metric is the tested series' name ("delta2/entropy", "linear_qkv/frobenius")
    metric_detectors: dict[str, dict[str, dict]] = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)  # provenance written by `calibrate` (read by nothing)
    detect_start: int = 0  # samples before this step are logged but build no baseline (early training)
    detect_slots: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj"])  # ΔW slots tested
    detect_metrics: dict[str, list[str]] = field(default_factory=lambda: {
        "attention-spectral": ["delta2/entropy", "delta2/effective_rank", "delta2/top1_energy"],
        "update-spectral": ["entropy", "effective_rank", "top1_energy"],
        "router": ["entropy", "similarity", "max_over_mean"],
        # load_drift is recorded, not tested: drift against the first step grows on every healthy run
        "rl": ["topk_match", "any_layer_mismatch", "entropy", "gap_abs_mean"],
    })
    # per family: "layer" tests each layer's series, "mean" the mean over layers (reported with layer None);
    # the mean is the quieter signal for a fault that moves every layer, per layer catches one layer
    detect_scopes: dict[str, list[str]] = field(default_factory=lambda: {
        "attention-spectral": ["layer"], "update-spectral": ["layer"], "router": ["layer"], "rl": ["mean"]})
    output_dir: str = "mechanism_monitor"
    # where results go: files jsonl, csv in output_dir; tensorboard, wandb: the run's own writers when it has them
    # (Megatron-LM's --tensorboard-dir / --wandb-project, our --tensorboard-dir, DeepSpeed's monitor config);
    # leave them out to keep the monitor's scalars out of the run's writers
    sinks: list[str] = field(default_factory=lambda: list(SINKS))
    log_rank: int = 0  # global rank that writes sinks (all ranks hold identical results)
    per_head_records: bool = True  # JSONL carries per-head QK statistics, not only layer aggregates
    # expert features for convert_to_proxy.py (--features FILE, --usage-file): every expert applied to every
    # token of the global batch at the sampled training steps start, start+interval, ... (`steps` of them)
    expert_features: bool = False
    expert_features_start: int = 1  # first sampled optimizer step (1-based, Megatron's count)
    expert_features_interval: int = 1
    expert_features_steps: int = 1  # sampled steps in the window; written after the last (or at training end)

    def __post_init__(self):
        if self.delta is None:  # derived (docs/monitor.md); a δ given above the interval is refused below
            self.delta = min(DEFAULT_DELTA, self.interval) if isinstance(self.interval, int) else DEFAULT_DELTA
        for name in ("interval", "delta", "router_interval", "qk_gram_reuse", "experts_per_layer", "log_rank",
                     "detect_start"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: expected an integer, got {value!r}")
        for name in ("qk_terms", "update_matrices", "families", "sinks", "detect_slots"):
            if not isinstance(getattr(self, name), list):
                raise ValueError(f"{name}: expected a list, got {getattr(self, name)!r}")
        bad = [f for f in self.families if f not in FAMILIES]
        if bad:
            raise ValueError(f"families: unknown {bad}; expected a subset of {list(FAMILIES)}")
        if isinstance(self.detector, dict):
            self.detector = DetectorConfig(**self.detector)
        if isinstance(self.router_detector, dict):
            self.router_detector = DetectorConfig(**self.router_detector)
        if isinstance(self.rl_detector, dict):
            self.rl_detector = DetectorConfig(**self.rl_detector)
        for metric, overrides in self.rl_metric_detectors.items():
            dataclasses.replace(self.rl_detector, **overrides)  # an unknown key fails here, naming it
        if not isinstance(self.metric_detectors, dict):
            raise ValueError("metric_detectors: expected {family: {metric: {detector key: value}}}")
        for family, metrics in self.metric_detectors.items():
            if family not in FAMILIES or not isinstance(metrics, dict):
                raise ValueError(f"metric_detectors: {family!r} is not one of {FAMILIES} with a mapping of metrics")
            for metric, overrides in metrics.items():
                try:
                    dataclasses.replace(self.family_detector(family), **dict(overrides))
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"metric_detectors {family}/{metric}: {exc}") from None
        if self.interval < 1 or not 1 <= self.delta <= self.interval:
            raise ValueError(f"need interval ≥ 1 and 1 ≤ delta ≤ interval, got interval={self.interval}, "
                             f"delta={self.delta} (δ is never lowered for you: give a δ ≤ interval)")
        if self.qk_gram_reuse < 0:
            raise ValueError(f"qk_gram_reuse must be ≥ 0, got {self.qk_gram_reuse}")
        if self.router_interval < 1:
            raise ValueError(f"router_interval must be ≥ 1, got {self.router_interval}")
        bad = [t for t in self.qk_terms if t not in ("delta1", "delta2", "delta3")]
        if bad:
            raise ValueError(f"qk_terms: unknown {bad}; expected delta1, delta2, delta3")
        bad = [m for m in self.update_matrices if m not in UPDATE_MATRICES]
        if bad:
            raise ValueError(f"update_matrices: unknown {bad}; expected a subset of {list(UPDATE_MATRICES)}")
        bad = {f: v for f, v in self.detect_scopes.items()
               if not isinstance(v, list) or not set(v) <= {"layer", "mean"}}
        if bad:
            raise ValueError(f"detect_scopes: {bad}; expected lists of 'layer' and/or 'mean' per family")
        if min(self.expert_features_start, self.expert_features_interval, self.expert_features_steps) < 1:
            raise ValueError("expert_features_start, expert_features_interval and expert_features_steps must be ≥ 1, "
                             f"got {self.expert_features_start}, {self.expert_features_interval}, "
                             f"{self.expert_features_steps}")
        bad = [s for s in self.sinks if s not in ("jsonl", "csv", "tensorboard", "wandb")]
        if bad:
            raise ValueError(f"sinks: unknown {bad}; expected jsonl, csv, tensorboard, wandb")

    def rl_detector_configs(self) -> dict[str, DetectorConfig]:
        """Per-metric detector configs of the rl family (rl_detector overlaid with rl_metric_detectors)."""
        return {m: dataclasses.replace(self.rl_detector, **o) for m, o in self.rl_metric_detectors.items()}

    def family_detector(self, family: str) -> DetectorConfig:
        """The family-wide detector config of `family` (spectral families share `detector`)."""
        return {"router": self.router_detector, "rl": self.rl_detector}.get(family, self.detector)

    def metric_detector_configs(self, *families: str) -> dict[str, DetectorConfig]:
        """Per-metric detector configs of `families` (one bank): the family's detector overlaid with
        `rl_metric_detectors` (rl) and then `metric_detectors`; metrics without overrides are absent."""
        out = self.rl_detector_configs() if "rl" in families else {}
        for family in families:
            for metric, overrides in self.metric_detectors.get(family, {}).items():
                out[metric] = dataclasses.replace(out.get(metric, self.family_detector(family)), **overrides)
        return out

    def detector_banks(self) -> dict:
        """{family: DetectorBank} as the monitor builds them (the two spectral families share one bank)."""
        from mindspeed_proxy.monitor.detectors import DetectorBank

        spectral = DetectorBank(config=self.detector,
                                metric_configs=self.metric_detector_configs("attention-spectral", "update-spectral"))
        return {"attention-spectral": spectral, "update-spectral": spectral,
                "router": DetectorBank(config=self.router_detector, metric_configs=self.metric_detector_configs("router")),
                "rl": DetectorBank(config=self.rl_detector, metric_configs=self.metric_detector_configs("rl"))}

    def tested_metrics(self, family: str, metrics) -> list[str]:
        """The names among `metrics` (a family's per-layer metric names) that its detectors test."""
        wanted = self.detect_metrics.get(family, [])
        if family == "update-spectral":  # names are "slot/stat"; stats from detect_metrics, slots from detect_slots
            return [m for m in metrics if m.rsplit("/", 1)[-1] in wanted and m.rsplit("/", 1)[0] in self.detect_slots]
        return [m for m in metrics if m in wanted]

    def detection_series(self, family: str, per_layer: dict) -> dict[tuple, float]:
        """What the detectors test of one sample ({metric: {layer: value}}): {(family, metric, layer, None): v},
        per layer and/or (layer None) the mean over layers, as `detect_scopes` says."""
        scopes = self.detect_scopes.get(family, ["layer"])
        series = {}
        for metric in self.tested_metrics(family, per_layer):
            layers = per_layer[metric]
            if "layer" in scopes:
                series.update(((family, metric, layer, None), v) for layer, v in layers.items())
            if "mean" in scopes and layers:
                series[(family, metric, None, None)] = sum(float(v) for v in layers.values()) / len(layers)
        return series

    def snapshot_step(self, step: int) -> bool:
        """Whether W is snapshotted after optimizer step `step` (so that ΔW spans δ at the sample)."""
        return (step + self.delta) % self.interval == 0

    def sample_step(self, step: int) -> bool:
        """Whether the spectral families are sampled after optimizer step `step`."""
        return step % self.interval == 0 and step >= self.delta

    def expert_features_step(self, step: int) -> bool:
        """Whether the expert-feature collector samples the forward passes of optimizer step `step`."""
        offset = step - self.expert_features_start
        return (self.expert_features and offset >= 0 and offset % self.expert_features_interval == 0
                and offset // self.expert_features_interval < self.expert_features_steps)

    def expert_features_end(self) -> int:
        """The last sampled step of the expert-feature window (the files are written after it)."""
        return self.expert_features_start + (self.expert_features_steps - 1) * self.expert_features_interval

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MonitorConfig":
        """Build from a dict; unknown keys are an error that names them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown monitor config keys: {unknown}")
        return cls(**data)

    @classmethod
    def from_file(cls, path: str) -> "MonitorConfig":
        """Load a JSON (.json) or YAML (.yaml/.yml) file."""
        return cls.from_dict(cls.read_file(path))

    @staticmethod
    def read_file(path: str) -> dict[str, Any]:
        """The mapping in a JSON/YAML config file (only the keys it sets), validated."""
        if not os.path.isfile(path):
            raise ValueError(f"monitor config {path}: no such file")
        with open(path, encoding="utf-8") as fh:
            if path.endswith((".yaml", ".yml")):
                from mindspeed_proxy.extras import MissingExtra, require

                try:
                    yaml = require("yaml", f"monitor config {path}")
                except MissingExtra as exc:
                    raise ValueError(str(exc)) from None
                data = yaml.safe_load(fh) or {}
            else:
                data = json.load(fh)
        if not isinstance(data, dict):
            raise ValueError(f"monitor config {path}: expected a mapping at the top level")
        try:
            MonitorConfig.from_dict(data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"monitor config {path}: {exc}") from None
        return data
