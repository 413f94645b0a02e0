"""What a conversion keeps and drops per layer type (dense, MoE, MTP, other) and part of the layer: parameters
and bytes of the source's and of the written proxy's tensors, named as torch_dist names them (`decoder.layers.{l}.`
with global layer numbers, or stacked; legacy files are renamed so by io/legacy/summary.py)."""
from __future__ import annotations

import math
import re

import torch

from mindspeed_proxy.proxy.core.keys import STACKED, is_stacked
from mindspeed_proxy.proxy.core.refs import id_order

_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.")
PARTS = (("mlp.experts.", "routed experts"), ("mlp.shared_experts.", "shared expert"), ("mlp.", "dense MLP"))
TYPES = ("dense", "moe", "mtp", "other")


def _where(key: str, moe_layers: set) -> tuple:
    """(layer type, layer id or "stacked" or None, part) of one global tensor."""
    match = _MTP.match(key)
    if match:
        rest = key[match.end():]
        rest = rest[len("transformer_layer."):] if rest.startswith("transformer_layer.") else "mtp." + rest
        return "mtp", f"mtp.{match.group(1)}", _part(rest)
    match = _PER_LAYER.match(key)
    if match:
        layer = int(match.group(1))
        return "moe" if layer in moe_layers else "dense", layer, _part(key[match.end():])
    if is_stacked(key):  # homogeneous layers: all MoE when any layer is
        return "moe" if moe_layers else "dense", "stacked", _part(key[len(STACKED):])
    return "other", None, "embedding, output layer, final norm"


def _part(rest: str) -> str:
    if rest.startswith("mlp.router."):
        return "router " + rest[len("mlp.router."):]  # weight (rows), expert_bias, bias
    for prefix, name in PARTS:
        if rest.startswith(prefix):
            return name
    return "attention, norms" if not rest.startswith("mtp.") else "MTP eh_proj, enorm, hnorm, final norm"


def _tally(tensors: dict, moe_layers: set) -> tuple:
    """({(type, part): [params, bytes]}, {type: set of layer ids})."""
    out, layers = {}, {t: set() for t in TYPES}
    for key, (shape, dtype) in tensors.items():
        numel = math.prod(shape)
        size = numel * torch.empty((), dtype=dtype).element_size()
        kind, layer, part = _where(key, moe_layers)
        if layer == "stacked":
            layers[kind].update(range(shape[0]) if kind == "dense" else moe_layers)
        elif layer is not None:
            layers[kind].add(layer)
        row = out.setdefault((kind, part), [0, 0])
        row[0] += numel
        row[1] += size
    return out, layers


def layer_type_summary(before: dict, after: dict, plan) -> dict:
    """Parameters and bytes per (layer type, part), source -> proxy, the layers of each type, and per MoE layer
    the routed experts kept and dropped (global ids); `before` / `after`: {key: (shape, dtype)} of source and
    proxy (io/dist/summary.py, io/legacy/summary.py)."""
    moe_layers = {layer.global_layer for layer in plan.kept if layer.mtp is None}
    src, src_layers = _tally(before, moe_layers)
    dst, _ = _tally(after, moe_layers)
    rows = [{"type": kind, "part": part, "params": [src[kind, part][0], dst.get((kind, part), [0, 0])[0]],
             "bytes": [src[kind, part][1], dst.get((kind, part), [0, 0])[1]]}
            for kind in TYPES for part in sorted({p for k, p in src if k == kind})]
    experts = range(plan.source.num_experts)
    selection = [{"layer": layer.id, "kept": list(kept), "dropped": [g for g in experts if g not in kept]}
                 for layer, kept in plan.kept.items()]
    total = [sum(r["params"][i] for r in rows) for i in (0, 1)], [sum(r["bytes"][i] for r in rows) for i in (0, 1)]
    return {"layers": {kind: sorted(ids, key=id_order) for kind, ids in src_layers.items()}, "parts": rows,
            "experts": selection, "total": {"params": total[0], "bytes": total[1]}}


def describe_layer_types(summary: dict) -> str:
    """The summary as printed lines: one per layer type and part, one per MoE layer's kept / dropped experts."""
    lines = ["per layer type (params, bytes: source -> proxy):"]
    for kind, ids in summary["layers"].items():
        parts = [r for r in summary["parts"] if r["type"] == kind]
        if parts:
            lines.append(f"  {kind} layers {ids}:" if ids else f"  {kind}:")
        for row in parts:
            (p0, p1), (b0, b1) = row["params"], row["bytes"]
            lines.append(f"    {row['part']:<38} {p0:>14,} -> {p1:<14,} {b0:>15,} B -> {b1:,} B")
    for entry in summary["experts"]:
        name = entry["layer"] if isinstance(entry["layer"], str) else f"layer {entry['layer']}"
        lines.append(f"  {name}: routed experts kept {entry['kept']} dropped {entry['dropped']}")
    (p0, p1), (b0, b1) = summary["total"]["params"], summary["total"]["bytes"]
    lines.append(f"  total: {p0:,} -> {p1:,} params ({p1 / max(p0, 1):.1%}), {b0:,} -> {b1:,} bytes")
    return "\n".join(lines)
