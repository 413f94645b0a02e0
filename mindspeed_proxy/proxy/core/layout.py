"""Parallel layout of an MoE checkpoint: global expert ids, EP ownership, rules for the proxy's K."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from mindspeed_proxy.proxy.core.errors import ConversionError


@dataclass(frozen=True)
class Layout:
    """TP/PP/EP sizes, expert count and MindSpeed's tp-extend-ep flag of one checkpoint (or its proxy)."""

    tp: int
    pp: int
    ep: int
    num_experts: int
    dp: int
    vpp: Optional[int] = None
    tp_extend_ep: bool = False

    @property
    def expert_shards(self) -> int:
        """Files the expert axis is split over: EP, or EP x TP with moe_tp_extend_ep."""
        return self.ep * (self.tp if self.tp_extend_ep else 1)

    @property
    def num_local_experts(self) -> int:
        """Experts held by one (TP, EP) file."""
        return self.num_experts // self.expert_shards

    @property
    def world_size(self) -> int:
        """Accelerators of this layout (TP x PP x DP)."""
        return self.tp * self.pp * self.dp

    def global_id(self, ep_rank: int, tp_rank: int, local: int) -> int:
        """Megatron's global expert id (DESIGN §4), MindSpeed's variant with moe_tp_extend_ep."""
        shard = ep_rank * self.tp + tp_rank if self.tp_extend_ep else ep_rank
        return shard * self.num_local_experts + local

    def owner(self, global_id: int, tp_rank: int) -> tuple[int, int, int]:
        """(tp_rank, ep_rank, local index) of the file holding `global_id`'s piece for `tp_rank`."""
        shard, local = divmod(global_id, self.num_local_experts)
        if self.tp_extend_ep:
            return shard % self.tp, shard // self.tp, local
        return tp_rank, shard, local

    def mapping(self) -> dict:
        """{global id: [ep_rank, local]} (tp-extend-ep: [ep_rank, tp_rank, local]) for the manifest."""
        out = {}
        for g in range(self.num_experts):
            tp_rank, ep_rank, local = self.owner(g, 0)
            out[g] = [ep_rank, tp_rank, local] if self.tp_extend_ep else [ep_rank, local]
        return out


def layout_from_args(args) -> Layout:
    """The Layout recorded in a checkpoint's Megatron `args`; ConversionError if it is not an MoE model."""
    num_experts = getattr(args, "num_experts", None)
    if not num_experts:
        raise ConversionError("checkpoint args have no num_experts: not an MoE checkpoint")
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    world = getattr(args, "world_size", None)
    dp = getattr(args, "data_parallel_size", None) or (world // (tp * pp) if world else ep)
    layout = Layout(tp=tp, pp=pp, ep=ep, num_experts=int(num_experts), dp=int(dp),
                    vpp=getattr(args, "virtual_pipeline_model_parallel_size", None),
                    tp_extend_ep=bool(getattr(args, "moe_tp_extend_ep", False)))
    if num_experts % layout.expert_shards:
        raise ConversionError(f"checkpoint args: num_experts {num_experts} is not divisible by its expert "
                              f"shards {layout.expert_shards} (EP {ep}{' x TP' if layout.tp_extend_ep else ''})")
    return layout


def target_layout(source: Layout, ep2: int, k: int) -> Layout:
    """The proxy's layout: same TP/PP/VPP, EP2, K experts, the smallest data-parallel size EP2 allows.

    The expert-data-parallel replication of the source (DP / EP) is dropped: the proxy runs on
    TP x PP x EP2 accelerators, with the same global batch split over more micro-batches."""
    return replace(source, ep=ep2, num_experts=k, dp=ep2)


def k_violations(k: int, ep2: int, tp: int, topk: int, num_experts: int, tp_extend_ep: bool = False,
                 num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                 min_per_group: Optional[int] = None) -> list[str]:
    """Every rule K breaks (empty if K is valid), each spelled out. `min_per_group`: experts each routing
    group must keep (Hugging Face DeepSeek-V3 scores a group by its top 2 experts)."""
    problems = []
    shards = ep2 * (tp if tp_extend_ep else 1)
    if k < 1 or k > num_experts:
        problems.append(f"K must lie in [1, {num_experts}] (the source has {num_experts} experts)")
    if k % shards:
        rule = f"EP2 x TP = {ep2} x {tp}" if tp_extend_ep else f"EP2 = {ep2}"
        problems.append(f"K must be divisible by {rule}")
    if k < topk:
        problems.append(f"K must be >= moe_router_topk = {topk}")
    if num_groups:
        if k % num_groups:
            problems.append(f"K must be divisible by moe_router_num_groups = {num_groups}")
        elif group_topk and (k // num_groups) * group_topk < topk:
            problems.append(f"K / moe_router_num_groups x moe_router_group_topk = {k // num_groups} x "
                            f"{group_topk} must be >= moe_router_topk = {topk}")
        if min_per_group and k // num_groups < min_per_group:
            problems.append(f"K / moe_router_num_groups = {k // num_groups} must be >= {min_per_group} "
                            "(experts the router scores each group by)")
    return problems


def valid_k_values(**rules) -> list[int]:
    """All valid K for the rules of `k_violations` (same keyword arguments, without k)."""
    return [k for k in range(1, rules["num_experts"] + 1) if not k_violations(k, **rules)]


def check_k(k: int, **rules) -> None:
    """Raise ConversionError naming the broken rules and the nearest valid K values."""
    problems = k_violations(k, **rules)
    if not problems:
        return
    valid = valid_k_values(**rules)
    below = [v for v in valid if v < k][-1:]
    above = [v for v in valid if v > k][:1]
    nearest = ", ".join(str(v) for v in below + above) or "none"
    raise ConversionError(f"--target-num-experts {k} is invalid: {'; '.join(problems)}; "
                          f"nearest valid K: {nearest}")


def check_target_ep(source: Layout, ep2: int) -> None:
    """EP2 must be positive; ConversionError otherwise."""
    if ep2 < 1:
        raise ConversionError(f"--target-expert-parallel-size {ep2} must be >= 1")
