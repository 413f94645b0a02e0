"""The conversion plan's type and the Megatron args it rewrites for the proxy's layout."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional

from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.core.layout import Layout
from mindspeed_proxy.proxy.core.options import Options

REWRITTEN_ARGS = ("num_experts", "expert_model_parallel_size", "world_size", "data_parallel_size")


@dataclass
class Plan:
    """Everything the writer and the verifier need, and what the dry run prints."""

    source: Layout
    target: Layout
    options: Options
    kept: dict = field(default_factory=dict)      # LayerRef -> kept source global ids, ascending
    details: dict = field(default_factory=dict)   # LayerRef -> cluster_layer() result
    non_finite: dict = field(default_factory=dict)  # LayerRef -> {global id: [tensors holding NaN/Inf]}
    new_args: Optional[argparse.Namespace] = None
    args_diff: dict = field(default_factory=dict)
    bytes_to_write: int = 0
    inputs: dict = field(default_factory=dict)    # fingerprints of the data that chose the experts
    vectors: dict = field(default_factory=dict)   # global layer -> [E, D] features (outputs / FILE)
    fmt: str = "torch"                            # the source's format: torch, torch_dist or hf


def rules_from_args(args, layout: Layout, ep2: int) -> dict:
    """Keyword arguments of layout.check_k for this checkpoint and EP2."""
    return dict(ep2=ep2, tp=layout.tp, topk=int(getattr(args, "moe_router_topk", 2) or 1),
                num_experts=layout.num_experts, tp_extend_ep=layout.tp_extend_ep,
                num_groups=getattr(args, "moe_router_num_groups", None),
                group_topk=getattr(args, "moe_router_group_topk", None),
                min_per_group=getattr(args, "moe_router_min_experts_per_group", None))


def rewrite_args(args, target: Layout) -> tuple:
    """A copy of `args` with Megatron's expert/world fields for `target`, and the {field: [old, new]} diff."""
    new = argparse.Namespace(**vars(args))
    values = {"num_experts": target.num_experts, "expert_model_parallel_size": target.ep,
              "world_size": target.world_size, "data_parallel_size": target.dp}
    diff = {}
    for name, value in values.items():
        if getattr(args, name, None) != value:
            diff[name] = [getattr(args, name, None), value]
        setattr(new, name, value)
    return new, diff


def kept_of(plan: Plan, layer_id) -> list:
    """Kept source expert ids of the layer whose LayerRef.id is `layer_id` (global layer, or `mtp.N`)."""
    for layer, kept in plan.kept.items():
        if layer.id == layer_id:
            return kept
    raise ConversionError(f"layer {layer_id} has experts but no plan")
