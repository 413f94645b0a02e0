"""A features FILE (`--features FILE`): per-layer [E, D] expert vectors, read and validated, or written."""
from __future__ import annotations

import os

import numpy as np
import torch

from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.core.refs import id_order


def _load_features(path: str) -> dict:
    if not path.endswith((".npz", ".pt")):
        raise ConversionError(f"--features {path}: not 'weights' or 'outputs', and not a .npz / .pt features file")
    if not os.path.isfile(path):
        raise ConversionError(f"--features {path}: no such file (expected 'weights', 'outputs' or a features FILE)")
    try:
        if path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as archive:
                return {k: archive[k] for k in archive.files}
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt, truncated or pickled objects: refuse, never execute
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConversionError(f"--features {path}: cannot read ({type(exc).__name__}: {first})") from None
    if not isinstance(raw, dict):
        raise ConversionError(f"--features {path}: expected a mapping {{\"<global layer>\": [E, D] array}}, "
                              f"found {type(raw).__name__}")
    return {str(k): v.numpy() if isinstance(v, torch.Tensor) else v for k, v in raw.items()}


def read_features_file(path: str, layers: list, num_experts: int) -> dict:
    """{global layer: [E, D] float64} from a features FILE (.npz or .pt mapping "<global layer>" -> [E, D])."""
    raw = _load_features(path)
    wanted = {str(layer.id) for layer in layers}
    extra = sorted(set(raw) - wanted)
    if extra:
        raise ConversionError(f"--features {path}: key {extra[0]!r} is not a MoE layer of the checkpoint "
                              f"(MoE layers: {', '.join(sorted(wanted, key=id_order))}; global 0-based numbering, "
                              "mtp.N for multi-token prediction layers)")
    out = {}
    for layer in layers:
        key = str(layer.id)
        if key not in raw:
            raise ConversionError(f"--features {path}: no features for MoE layer {key}")
        value = raw[key]
        if not isinstance(value, np.ndarray) or value.ndim != 2 or value.shape[0] != num_experts \
                or value.shape[1] < 1 or not np.issubdtype(value.dtype, np.number):
            shape = list(value.shape) if isinstance(value, np.ndarray) else type(value).__name__
            raise ConversionError(f"--features {path}: layer {key} needs a numeric array [{num_experts}, D], "
                                  f"found {shape}")
        value = value.astype(np.float64)
        if not np.isfinite(value).all():
            raise ConversionError(f"--features {path}: layer {key} holds non-finite values (nan/inf)")
        out[layer.id] = value
    return out


def write_features_file(path: str, vectors: dict) -> None:
    """Write {global layer: [E, D]} as a features FILE (.npz, float64), atomically (temporary name, rename)."""
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    try:
        np.savez(tmp, **{str(k): np.asarray(v, dtype=np.float64) for k, v in vectors.items()})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
