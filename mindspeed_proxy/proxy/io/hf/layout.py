"""Hugging Face MoE checkpoints: the config fields and state-dict keys of routed experts, per architecture.

Supported `model_type`s and what the converter relies on (checked against transformers' modeling code):

- `qwen2_moe`, `qwen3_moe`: `mlp.gate.weight` [E, H] (softmax, top-k, optional `norm_topk_prob`),
  `mlp.experts.{i}.{gate,up,down}_proj.weight`; Qwen2-MoE's `mlp.shared_expert.*` and
  `mlp.shared_expert_gate.weight` are not routed and stay unchanged.
- `mixtral`: `block_sparse_moe.gate.weight` [E, H] (softmax, top-k, renormalised),
  `block_sparse_moe.experts.{i}.w{1,2,3}.weight`.
- `deepseek_v2`, `deepseek_v3`: `mlp.gate.weight` [E, H] (V3 also `mlp.gate.e_score_correction_bias` [E]),
  `mlp.experts.{i}.{gate,up,down}_proj.*`, `mlp.shared_experts.*` unchanged; group-limited routing
  over `n_group` contiguous groups (V3 always; V2 with `topk_method: group_limited_greedy`); the first
  `first_k_dense_replace` layers are dense.

Experts are read per expert (`experts.{i}.NAME`, the layout Hub checkpoints and `save_pretrained` use)
or fused (`experts.gate_up_proj` [E, 2F, H], `experts.down_proj` [E, H, F], transformers' in-memory
layout); the proxy is written in the layout that was read.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Optional

from mindspeed_proxy.proxy.core.errors import ConversionError

COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
FUSED_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>mlp|block_sparse_moe)\.)"
                  r"(?P<kind>experts|gate)\.(?P<rest>.+)$")
_EXPERT = re.compile(r"^(\d+)\.(.+)$")


@dataclass(frozen=True)
class Arch:
    """What differs between the supported architectures."""

    blocks: tuple           # names of the MoE block module inside a decoder layer
    projections: tuple      # module names every per-expert layout must hold
    group_limited: str      # "always", "never", or "topk_method" (V2: only for group_limited_greedy)
    min_per_group: int = 1  # experts each group must keep (V3 sums the top 2 scores of each group)


ARCHITECTURES = {
    "qwen2_moe": Arch(("mlp",), ("gate_proj", "up_proj", "down_proj"), "never"),
    "qwen3_moe": Arch(("mlp",), ("gate_proj", "up_proj", "down_proj"), "never"),
    "mixtral": Arch(("block_sparse_moe", "mlp"), ("w1", "w2", "w3"), "never"),
    "deepseek_v2": Arch(("mlp",), ("gate_proj", "up_proj", "down_proj"), "topk_method"),
    "deepseek_v3": Arch(("mlp",), ("gate_proj", "up_proj", "down_proj"), "always", min_per_group=2),
}


def expert_count(config: dict, where: str) -> int:
    """E from the expert-count fields of config.json (all present ones must agree); ConversionError if none."""
    found = {f: config[f] for f in COUNT_FIELDS if config.get(f) is not None}
    if not found or not all(isinstance(v, int) and not isinstance(v, bool) for v in found.values()) \
            or not any(found.values()):
        raise ConversionError(f"{where}: no {' / '.join(COUNT_FIELDS)} (or 0): not an MoE checkpoint")
    if len(set(found.values())) != 1:
        raise ConversionError(f"{where}: expert-count fields disagree: {found}")
    return next(iter(found.values()))


def architecture(config: dict, where: str) -> Arch:
    """The Arch of config.json's model_type; ConversionError for an unsupported one."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConversionError(f"{where}: model_type {model_type!r} is not supported (supported: "
                              f"{', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[model_type]


def routing_args(config: dict, num_experts: int, where: str) -> argparse.Namespace:
    """The routing fields plan.rules_from_args reads, from config.json (top-k, groups, group top-k)."""
    arch = architecture(config, where)
    topk = config.get("num_experts_per_tok")
    if not isinstance(topk, int) or topk < 1:
        raise ConversionError(f"{where}: num_experts_per_tok {topk!r} is not a positive integer")
    grouped = arch.group_limited == "always" or (
        arch.group_limited == "topk_method" and config.get("topk_method") == "group_limited_greedy")
    groups = config.get("n_group") if grouped else None
    group_topk = config.get("topk_group") if grouped else None
    if grouped and (not isinstance(groups, int) or groups < 1 or num_experts % groups):
        raise ConversionError(f"{where}: n_group {groups!r} does not divide {num_experts} experts")
    return argparse.Namespace(num_experts=num_experts, moe_router_topk=topk, moe_router_num_groups=groups,
                              moe_router_group_topk=group_topk,
                              moe_router_min_experts_per_group=arch.min_per_group if grouped else None)


def expected_moe_layers(config: dict) -> Optional[set]:
    """Decoder layers (0-based, < num_hidden_layers) that config.json makes MoE layers; None if unknown."""
    n = config.get("num_hidden_layers")
    if not isinstance(n, int):
        return None
    model_type = config.get("model_type")
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step = config.get("decoder_sparse_step", 1) or 1
        dense = set(config.get("mlp_only_layers") or [])
        return {i for i in range(n) if i not in dense and (i + 1) % step == 0}
    if model_type in ("deepseek_v2", "deepseek_v3"):
        first = config.get("first_k_dense_replace", 0) or 0
        freq = config.get("moe_layer_freq", 1) or 1
        return {i for i in range(n) if i >= first and i % freq == 0}
    return set(range(n))


@dataclass
class LayerKeys:
    """The keys of one MoE layer: router tensors and experts (per-expert {id: {name: key}}, or fused)."""

    prefix: str          # `model.layers.{i}.mlp.`
    global_layer: int
    router: dict         # {name: key}, e.g. {"weight": "...gate.weight", "e_score_correction_bias": ...}
    experts: dict        # per-expert: {id: {name: key}}; empty when fused
    fused: dict          # fused: {name: key} with the expert axis first; empty when per-expert

    @property
    def layout(self) -> str:
        """'fused' or 'per-expert'."""
        return "fused" if self.fused else "per-expert"


def find_layers(keys, arch: Arch, num_experts: int, where: str) -> list:
    """LayerKeys of every MoE layer in `keys`, by layer; ConversionError for incomplete or mixed experts."""
    layers: dict = {}
    for key in keys:
        m = _KEY.match(key)
        if not m or m.group("block") not in arch.blocks:
            continue
        entry = layers.setdefault(m.group("prefix"), LayerKeys(m.group("prefix"), int(m.group("layer")), {}, {}, {}))
        rest = m.group("rest")
        if m.group("kind") == "gate":
            entry.router[rest] = key
            continue
        e = _EXPERT.match(rest)
        if e:
            entry.experts.setdefault(int(e.group(1)), {})[e.group(2)] = key
        elif rest in FUSED_NAMES:
            entry.fused[rest] = key
        else:
            raise ConversionError(f"{where}: unknown expert tensor {key!r}")
    out = []
    for prefix, entry in sorted(layers.items(), key=lambda item: (item[1].global_layer, item[0])):
        name = f"{where}: layer {entry.global_layer} ({prefix})"
        if not entry.experts and not entry.fused:
            continue  # a `gate` without experts: not a routed MoE block (e.g. a gated dense MLP)
        if entry.experts and entry.fused:
            raise ConversionError(f"{name}: both per-expert and fused expert tensors")
        if "weight" not in entry.router:
            raise ConversionError(f"{name}: experts without a router ({prefix}gate.weight)")
        if entry.experts:
            _check_per_expert(entry, arch, num_experts, name)
        elif "gate_up_proj" not in entry.fused or "down_proj" not in entry.fused:
            raise ConversionError(f"{name}: fused experts need gate_up_proj and down_proj, found "
                                  f"{sorted(entry.fused)}")
        out.append(entry)
    return out


def _check_per_expert(entry: LayerKeys, arch: Arch, num_experts: int, name: str) -> None:
    ids = sorted(entry.experts)
    if ids != list(range(num_experts)):
        missing = sorted(set(range(num_experts)) - set(ids))
        extra = sorted(set(ids) - set(range(num_experts)))
        raise ConversionError(f"{name}: experts {ids[0]}..{ids[-1]} ({len(ids)}) named in the index, config says "
                              f"{num_experts} (missing {missing[:4]}, unexpected {extra[:4]})")
    names = set(entry.experts[0])
    for i in ids:
        if set(entry.experts[i]) != names:
            raise ConversionError(f"{name}: expert {i} holds {sorted(entry.experts[i])}, expert 0 holds "
                                  f"{sorted(names)}")
    modules = {n.split(".")[0] for n in names}
    if not set(arch.projections) <= modules:
        raise ConversionError(f"{name}: expert modules {sorted(modules)}, expected {list(arch.projections)}")


def renamed_expert_key(entry: LayerKeys, new_id: int, name: str) -> str:
    """The proxy's key of kept expert `new_id` (its position in the kept list), tensor `name`."""
    return f"{entry.prefix}experts.{new_id}.{name}"


def rewrite_config(config: dict, k: int) -> tuple:
    """A copy of config.json with every expert-count field present set to K, and {field: [old, new]}."""
    new = dict(config)
    diff = {}
    for f in COUNT_FIELDS:
        if config.get(f) is not None:
            new[f] = k
            if config[f] != k:
                diff[f] = [config[f], k]
    return new, diff
