"""Every collective of the monitor, in one place, over fixed-size per-layer tensors.

Rules that keep ranks matched and results identical everywhere:
- Each statistic lives in a tensor of the same global shape on every rank ([L, ...] for all layers),
  zero where this rank does not own the entry; ranks of pipeline stages without an MoE or attention
  layer still pass their zeros through every collective, so nothing hangs.
- Ownership: a replicated quantity (computed the same on every TP/EP rank of a stage) is contributed by
  TP rank 0 and EP rank 0 only; a per-head quantity by the TP rank holding the head; an expert quantity
  by the EP rank holding the expert (expert-TP rank 0). Then one SUM over TP, EP and PP groups gives
  every rank of a model replica the full table; data-parallel replicas compute the same values.
- Router token statistics are summed as Megatron sums its MoE metrics: over TP×CP (tokens are split by
  sequence parallelism / context parallelism), then over DP (which contains EP), then PP for layers.
- Expert features (every expert on every token): the MoE input is all-gathered over expert-TP×EP (as the
  allgather dispatcher gathers it), each rank applies its local experts, and the [E, H] sums (rows of the
  other ranks' experts zero) are summed over expert-TP×EP, then expert-DP (the other tokens), then PP.
- Failure flags are agreed over the whole world (MAX), so a statistic is disabled on all ranks at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class MonitorGroups:
    """Explicit process groups and ranks the monitor reduces over (None = size 1 / not distributed)."""

    tp: Any = None
    tp_cp: Any = None
    dp: Any = None
    pp: Any = None
    ep: Any = None
    etp: Any = None
    world: Any = None
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    global_rank: int = 0
    etp_ep: Any = None  # expert-tensor × expert-model parallel group (the allgather dispatcher's tokens)
    edp: Any = None  # expert data-parallel group (same experts, other tokens)

    @classmethod
    def from_parallel_state(cls) -> "MonitorGroups":
        """Groups of megatron-core's initialised parallel_state."""
        from megatron.core import parallel_state as ps

        return cls(
            tp=ps.get_tensor_model_parallel_group(),
            tp_cp=ps.get_tensor_and_context_parallel_group(),
            dp=ps.get_data_parallel_group(),
            pp=ps.get_pipeline_model_parallel_group(),
            ep=ps.get_expert_model_parallel_group(),
            etp=ps.get_expert_tensor_parallel_group(),
            world=dist.group.WORLD,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            cp_rank=ps.get_context_parallel_rank(),
            global_rank=dist.get_rank(),
            etp_ep=ps.get_expert_tensor_and_model_parallel_group(),
            edp=ps.get_expert_data_parallel_group(),
        )

    @property
    def owns_replicated(self) -> bool:
        """Whether this rank contributes quantities replicated over TP and EP."""
        return self.tp_rank == 0 and self.ep_rank == 0


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def _sum(tensor: torch.Tensor, group) -> None:
    if _active() and group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def all_reduce_grams(grams: list[torch.Tensor], group) -> None:
    """Sum partial Gram matrices over a TP (or expert-TP) group in one collective (in place)."""
    if not grams or not _active() or group is None or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grams])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for g in grams:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def share_model_table(table: torch.Tensor, groups: MonitorGroups) -> torch.Tensor:
    """Sum an ownership-masked [L, ...] table over TP, EP and PP so every rank holds all of it."""
    for group in (groups.tp, groups.ep, groups.pp):
        _sum(table, group)
    return table


def reduce_router_tokens(flat: torch.Tensor, groups: MonitorGroups) -> torch.Tensor:
    """Sum router token accumulators over TP×CP, then DP, then PP (layers of other stages are zero)."""
    for group in (groups.tp_cp, groups.dp, groups.pp):
        _sum(flat, group)
    return flat


def gather_tp(weight: torch.Tensor, groups: MonitorGroups) -> torch.Tensor:
    """All-gather a column-parallel weight's rows over TP (for TP > query groups)."""
    if not _active() or groups.tp is None or groups.tp_size == 1:
        return weight
    parts = [torch.empty_like(weight) for _ in range(groups.tp_size)]
    dist.all_gather(parts, weight.contiguous(), group=groups.tp)
    return torch.cat(parts, dim=0)


def gather_expert_tokens(tokens: torch.Tensor, groups: MonitorGroups) -> torch.Tensor:
    """All-gather [T, H] MoE-layer inputs over expert-TP×EP (equal T on every rank, as the dispatcher needs)."""
    group = groups.etp_ep
    if not _active() or group is None or dist.get_world_size(group) == 1:
        return tokens
    parts = [torch.empty_like(tokens) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tokens.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def reduce_expert_sums(table: torch.Tensor, groups: MonitorGroups) -> torch.Tensor:
    """Sum an [E, H] table of per-expert output sums over expert-TP×EP, expert-DP and PP (in place)."""
    for group in (groups.etp_ep, groups.edp, groups.pp):
        _sum(table, group)
    return table


def agree_on_failures(flags: torch.Tensor, groups: MonitorGroups) -> torch.Tensor:
    """MAX of per-statistic failure flags over the whole world, so all ranks disable the same ones."""
    if _active():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=groups.world)
    return flags


def head_owner(groups: MonitorGroups) -> bool:
    """Whether this rank contributes its local heads (EP rank 0 of its TP group)."""
    return groups.ep_rank == 0
