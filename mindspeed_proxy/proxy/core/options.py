"""Options: what the user asked the converter for, with every default resolved here (API and CLI alike)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mindspeed_proxy.proxy.core.errors import ConversionError

CHOICES = {
    "cluster": ("agglomerative", "kmeans"),
    "representative": ("medoid", "usage", "saliency", "merge"),
    "selection": ("cluster", "random", "usage", "reconstruction"),
    "reconstruction_inputs": ("proxy", "original"),
    "non_finite_experts": ("refuse", "keep", "exclude"),
}


@dataclass
class Options:
    """What the user asked for (the CLI flags); None means "the default", resolved in __post_init__.

    Defaults (docs/proxy.md): features weights; cluster agglomerative, kmeans with usage_weighted;
    representative medoid; selection reconstruction when calibration_data is given and no clustering option
    (features, cluster, representative, usage_weighted) is, else cluster.
    """

    target_ep: int
    target_k: int
    features: Optional[str] = None  # weights, outputs or a FILE of per-layer features
    cluster: Optional[str] = None  # agglomerative or kmeans
    representative: Optional[str] = None  # medoid, usage, saliency (REAP-like) or merge (not bit-exact)
    usage_weighted: bool = False  # k-means with the experts' usage shares as sample weights
    seed: int = 0
    selection: Optional[str] = None  # cluster; random: the baseline of the same K; usage: the K most-used;
    # reconstruction: the K-subset whose layer output best matches the original's (select/reconstruction.py)
    reconstruction_inputs: str = "proxy"  # or "original": layer-local scoring (select/reconstruction.py)
    usage_file: Optional[str] = None  # JSON {global layer: [tokens routed per global expert]}
    calibration_data: Optional[str] = None  # tokens for features="outputs" (see calibration.py)
    calibration_sequences: int = 64
    keep_optimizer_args: bool = False  # keep opt_param_scheduler; launch without --finetune
    trust_checkpoint: bool = False  # full unpickling of the source's .pt files (never the default)
    non_finite_experts: str = "refuse"  # experts with NaN/Inf weights: refuse, keep (selectable) or exclude

    def __post_init__(self):
        if self.selection is None:
            self.selection = default_selection(self.calibration_data, self.features, self.cluster,
                                               self.representative, self.usage_weighted)
        if self.features is None:
            self.features = "weights"
        if self.cluster is None:
            self.cluster = "kmeans" if self.usage_weighted else "agglomerative"
        if self.representative is None:
            self.representative = "medoid"
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConversionError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: expected one of "
                                      f"{', '.join(allowed)}")
        for name in ("target_ep", "target_k", "calibration_sequences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConversionError(f"{name} must be a positive integer, got {value!r}")

    @property
    def bit_exact(self) -> bool:
        """False for --representative merge (kept experts and router rows are usage-weighted averages)."""
        return self.representative != "merge"

    @property
    def feature_type(self) -> str:
        """'weights', 'outputs' or 'file' (features is then the FILE's path)."""
        return self.features if self.features in ("weights", "outputs") else "file"


def default_selection(calibration_data, features=None, cluster=None, representative=None,
                      usage_weighted: bool = False) -> str:
    """reconstruction (the best in the fidelity table) when calibration data is given and no clustering option
    is, else cluster (the data-free fallback)."""
    clustering = any(v is not None for v in (features, cluster, representative)) or usage_weighted
    return "reconstruction" if calibration_data and not clustering else "cluster"
