"""Local (non-TE) core attention for megatron-core's MLA, whose query/key head dim differs from its value head dim.

megatron-core 0.16.1's `MLASelfAttention` builds its core attention with `k_channels` / `v_channels`,
which only `TEDotProductAttention` accepts: the local `DotProductAttention` raises on them, so the
local spec with `multi_latent_attention=True` cannot build. `MLADotProductAttention` is the local
module with those two arguments: scores use the q/k head dim (the tensors carry it), the context is
`v_channels` per head. It keeps `DotProductAttention.forward`, so patches of that method (the
lowp-attention fault) apply to MLA too, and it has no parameters (checkpoints are unchanged).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.transformer.dot_product_attention import DotProductAttention


class MLADotProductAttention(DotProductAttention):
    """`DotProductAttention` that accepts MLA's `k_channels` (q/k head dim) and `v_channels` (value head dim)."""

    def __init__(self, *args, k_channels: Optional[int] = None, v_channels: Optional[int] = None, **kwargs):
        # the rest is DotProductAttention's own signature, which differs by line (0.13-0.14 `model_comm_pgs`,
        # 0.15+ `pg_collection`); MLA passes every argument by keyword
        super().__init__(*args, **kwargs)
        if kwargs.get("softmax_scale") is None and k_channels is not None:
            self.softmax_scale = k_channels ** -0.5
        if v_channels is not None:  # forward views the context as [sq, b, hidden_size_per_partition]
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def q_norm_needs_te(qk_layernorm: bool, q_lora_rank) -> bool:
    """True where megatron-core (0.19+) would fuse MLA's Q norm into linear_q_proj, which needs Transformer Engine
    (qk_layernorm without q_lora_rank) and Transformer Engine is absent."""
    import importlib.util

    return bool(qk_layernorm and q_lora_rank is None and importlib.util.find_spec("transformer_engine") is None
                and importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config") is not None)


def with_mla_core_attention(spec):
    """Return `spec` (a megatron ModuleSpec / submodules tree) with MLA's local DotProductAttention replaced."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, (list, tuple)):
        return type(spec)(with_mla_core_attention(s) for s in spec)
    if isinstance(spec, MLASelfAttentionSubmodules):
        if spec.core_attention is DotProductAttention:
            return dataclasses.replace(spec, core_attention=MLADotProductAttention)
        return spec
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, submodules=with_mla_core_attention(spec.submodules))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: with_mla_core_attention(getattr(spec, f.name))
                   for f in dataclasses.fields(spec) if f.init}
        return dataclasses.replace(spec, **changes)
    return spec
