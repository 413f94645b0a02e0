"""`--representative merge` (HC-SMoE / MC-SMoE style, NOT bit-exact): each cluster becomes one expert.

The merged expert is the usage-weighted average of its cluster's experts (every weight tensor, accumulated
in float64, cast back to the source dtype); its router row (and `expert_bias` / `bias` entry) is the same
usage-weighted average of the members' rows. The merged expert takes the slot of the cluster's most-used
member (the id listed in `kept`). Weights come from `clustering.merge_weights` (plan.details[layer]["merge"]).
Without merge the functions here return the source's kept expert and router rows unchanged.
"""
from __future__ import annotations

import torch


def is_merge(plan) -> bool:
    """True when the plan merges clusters instead of keeping a representative."""
    return plan.options.representative == "merge"


def _members(plan, layer, rep: int) -> list:
    return plan.details[layer]["merge"][plan.kept[layer].index(rep)]


def average(tensors: list, weights: list) -> torch.Tensor:
    """sum_i weights[i] * tensors[i], accumulated in float64, in the first tensor's dtype."""
    total = torch.zeros(tensors[0].shape, dtype=torch.float64)
    for t, w in zip(tensors, weights):
        total += float(w) * t.to(torch.float64)
    return total.to(tensors[0].dtype)


def expert(ckpt, plan, layer, rep: int, tp: int) -> dict:
    """The proxy's expert in the slot of source expert `rep`: the source expert, or its cluster's merge."""
    if not is_merge(plan):
        return ckpt.expert(layer, rep, tp)
    members = _members(plan, layer, rep)
    parts = [ckpt.expert(layer, g, tp) for g, _ in members]
    weights = [w for _, w in members]
    return {name: average([p[name] for p in parts], weights) if isinstance(value, torch.Tensor) else value
            for name, value in parts[0].items()}


def router_rows(plan, layer, value: torch.Tensor) -> torch.Tensor:
    """The proxy's rows of a router tensor (weight [E, H], expert_bias [E] or bias [E]), in kept order."""
    kept = plan.kept[layer]
    if not is_merge(plan):
        return value.index_select(0, torch.tensor(kept, dtype=torch.long)).clone()
    rows = []
    for rep in kept:
        members = _members(plan, layer, rep)
        rows.append(average([value[g] for g, _ in members], [w for _, w in members]))
    return torch.stack(rows)
