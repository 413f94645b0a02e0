"""`proxy_manifest.json`: where the proxy came from and exactly what was kept."""
from __future__ import annotations

import hashlib
import json
import os
import time

from mindspeed_proxy.proxy.io import hashing

MANIFEST = "proxy_manifest.json"


def sha256(path: str, block: int = 16 << 20) -> str:
    """Hex SHA-256 of a file, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("torch", "megatron-core", "mindspeed-proxy", "scipy", "scikit-learn", "safetensors",
                    "transformers"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = None
    return out


def build_manifest(ckpt, plan, source_hashes: dict, verification: dict, fmt: str) -> dict:
    """The manifest as a JSON-able dict."""
    s, t = plan.source, plan.target
    inputs = plan.inputs
    calibration_usage = inputs.get("calibration_usage") or {}
    calibration_saliency = inputs.get("calibration_saliency") or {}
    layers = []
    for layer, kept in plan.kept.items():
        d = plan.details[layer]
        layers.append({"layer": layer.id, "pipeline_stage": layer.pp, "chunk": layer.chunk,
                       "prefix": layer.prefix, "kept_global_ids_in_new_order": kept,
                       "cluster_labels": d["labels"], "cluster_sizes": d["sizes"], "distances": d["distances"],
                       "calibration_usage": calibration_usage.get(layer.id),
                       "calibration_saliency": calibration_saliency.get(layer.id),
                       "non_finite_experts": sorted(plan.non_finite.get(layer, {})),
                       "excluded_from_selection": d.get("excluded", []),
                       **({"merge_weights": d["merge"]} if "merge" in d else {}),
                       **({"reconstruction": d["reconstruction"]} if "reconstruction" in d else {})})
    return {
        "format": fmt,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": {"path": os.path.abspath(ckpt.root), "iteration": ckpt.iteration, "hash": hashing.ALGORITHM,
                   "digests": {os.path.relpath(p, ckpt.root): h for p, h in source_hashes.items()}},
        "versions": _versions(),
        "num_experts": {"source": s.num_experts, "proxy": t.num_experts},
        "selection": plan.options.selection,
        "feature_type": plan.options.feature_type,
        "features": plan.options.features,
        "cluster": plan.options.cluster,
        "representative": plan.options.representative,
        "usage_weighted": plan.options.usage_weighted,
        "bit_exact": plan.options.bit_exact,  # False with merge: experts and router rows are averages
        "usage_source": inputs.get("usage_source"),
        "seed": plan.options.seed,
        "calibration_fingerprint": _fingerprint(inputs),
        "calibration_tokens": (inputs.get("calibration_data") or {}).get("tokens"),
        "inputs": {k: inputs.get(k) for k in ("usage_file", "calibration_data", "features_file")},
        "keep_optimizer_args": plan.options.keep_optimizer_args,
        "non_finite_experts": {"mode": plan.options.non_finite_experts, "experts": [
            {"layer": layer.id, "expert": g, "tensors": tensors, "kept_in_proxy": g in plan.kept[layer]}
            for layer, found in plan.non_finite.items() for g, tensors in sorted(found.items())]},
        "ep_mapping": {"source": {"expert_model_parallel_size": s.ep, "tp_extend_ep": s.tp_extend_ep,
                                  "global_id_to_rank_local": s.mapping()},
                       "proxy": {"expert_model_parallel_size": t.ep, "tp_extend_ep": t.tp_extend_ep,
                                 "global_id_to_rank_local": t.mapping()}},
        "accelerators": {"source": s.world_size, "proxy": t.world_size},
        "args_diff": plan.args_diff,
        "dropped": [] if fmt == "hf" else
        (["optimizer.* tensors", "optimizer (common state)", "rng_state objects", "rerun_state_machine_state objects"]
         if fmt == "torch_dist"
         else ["optimizer", "rng_state", "rerun_state_machine", "distrib_optim.pt"])
        + ([] if plan.options.keep_optimizer_args else ["opt_param_scheduler"]),
        **({"hf": ckpt.manifest_info()} if fmt == "hf" else {}),
        "layers": layers,
        "verification": verification,
    }


def _fingerprint(inputs: dict):
    """SHA-256 of the data beyond the weights that chose the experts: calibration token ids, else the
    features FILE, else the usage file; None for data-free features."""
    if inputs.get("calibration_data"):
        return inputs["calibration_data"]["tokens_sha256"]
    for key in ("features_file", "usage_file"):
        if inputs.get(key):
            return inputs[key]["sha256"]
    return None


def write_manifest(folder: str, manifest: dict) -> str:
    """Write `manifest` to folder/proxy_manifest.json; return its path."""
    path = os.path.join(folder, MANIFEST)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1)
    return path
