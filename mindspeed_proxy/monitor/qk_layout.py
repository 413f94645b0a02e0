"""Per-head query/key blocks from megatron-core's fused `linear_qkv` weight (MHA, GQA, MQA, any TP).

megatron-core stores, per query group g, the rows [q heads of g (n_q/n_kv of them), k_g, v_g], each
head_dim rows, in the [out, in] weight of the column-parallel `linear_qkv`. Column-parallel TP splits
whole groups when n_kv ≥ TP; with n_kv < TP a rank holds a slice of one group, so the caller passes
the all-gathered weight and each rank takes its n_q/TP query heads (megatron's own split). Learnable
q/k layernorm scales multiply the rows of each head (folded into the columns of the d×h block).
MLA (`MLASelfAttention`) is not covered here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class QKLayout:
    """Head counts of one attention layer and this rank's TP coordinate."""

    num_heads: int
    num_groups: int
    head_dim: int
    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self):
        if self.num_heads % self.num_groups or self.num_heads % self.tp_size:
            raise ValueError(f"heads {self.num_heads} must be divisible by groups {self.num_groups} and by "
                             f"TP {self.tp_size}")
        if self.num_groups >= self.tp_size and self.num_groups % self.tp_size:
            raise ValueError(f"query groups {self.num_groups} not divisible by TP {self.tp_size}")

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_heads // self.num_groups

    @property
    def needs_full_weight(self) -> bool:
        """True when TP > n_kv: a rank's shard is not whole groups, so pass the all-gathered weight."""
        return self.num_groups < self.tp_size

    def local_heads(self) -> list[int]:
        """Global indices of the query heads this TP rank computes."""
        per_rank = self.num_heads // self.tp_size
        return list(range(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank))


@torch.no_grad()
def qk_blocks(weight: torch.Tensor, layout: QKLayout, q_scale: Optional[torch.Tensor] = None,
              k_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Query and key blocks [n_local_heads, d, h] of this rank's heads (key block repeated per query head).

    `weight` is this rank's `linear_qkv.weight` [rows, d], or the TP-all-gathered one when
    `layout.needs_full_weight`. `q_scale` / `k_scale` are the q/k layernorm weights [h] (or None).
    """
    h, qpg = layout.head_dim, layout.heads_per_group
    groups = layout.num_groups if layout.needs_full_weight else layout.num_groups // layout.tp_size
    rows = weight.view(groups, qpg + 2, h, weight.shape[-1])
    wq = rows[:, :qpg].reshape(groups * qpg, h, -1)
    wk = rows[:, qpg:qpg + 1].expand(groups, qpg, h, rows.shape[-1]).reshape(groups * qpg, h, -1)
    if layout.needs_full_weight:
        heads = torch.tensor(layout.local_heads(), device=weight.device)
        wq, wk = wq[heads], wk[heads]
    if q_scale is not None:
        wq = wq * q_scale.to(wq.dtype).view(1, h, 1)
    if k_scale is not None:
        wk = wk * k_scale.to(wk.dtype).view(1, h, 1)
    return wq.transpose(1, 2), wk.transpose(1, 2)


def group_shared_keys(wq_old: torch.Tensor, wk_old: torch.Tensor, wq_new: torch.Tensor, wk_new: torch.Tensor,
                      layout: QKLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`qk_blocks` outputs [n, d, h] as queries [groups, n_q/n_kv, d, h] and keys [groups, 1, d, h] (views).

    One key block per KV group, so the QK core computes its Gram once; unchanged (one key copy per
    query head) unless this rank holds whole groups in order, i.e. GQA without `needs_full_weight`.
    """
    qpg, n = layout.heads_per_group, wq_old.shape[0]
    if qpg == 1 or layout.needs_full_weight or n % qpg:
        return wq_old, wk_old, wq_new, wk_new
    shape = (n // qpg, qpg)
    return (wq_old.unflatten(0, shape), wk_old.unflatten(0, shape)[:, :1],
            wq_new.unflatten(0, shape), wk_new.unflatten(0, shape)[:, :1])


def layout_of(attention) -> QKLayout:
    """QKLayout of a megatron-core SelfAttention module at the current TP size/rank."""
    from megatron.core import parallel_state as ps

    config = attention.config
    return QKLayout(
        num_heads=config.num_attention_heads,
        num_groups=config.num_query_groups or config.num_attention_heads,
        head_dim=config.kv_channels,
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
    )


def layernorm_scale(module, zero_centered: bool = False) -> Optional[torch.Tensor]:
    """The effective learnable scale of a q/k layernorm module (weight, +1 if zero-centred), or None."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    return weight + 1 if zero_centered or getattr(module, "zero_centered_gamma", False) else weight
