"""Which weights of a megatron-core model the monitor watches, with their TP sharding and owner rank.

Walks the model chunks once. Per global layer (0-based `layer_number - 1`) it lists fixed slots —
`linear_qkv`, `linear_proj`, `router`, `mlp.fc1`, `mlp.fc2` (the dense MLP, or the shared expert of a
MoE layer) and `expert{j}.fc1/fc2` for a fixed sample of global expert ids — so every rank agrees on
the shape of every statistic whatever layers and experts it holds. Weights are read from the
highest-precision copy available: the fp32 main param of Megatron's (non-distributed) mixed-precision
optimizer when it has one, else the model param itself (fp32 training: it is the master; the
distributed optimizer keeps only a DP shard of the fp32 copy, so its bf16 model param is used).
MLA layers have no `linear_qkv` slot: their q/kv projections feed the attention-spectral family only.
Multi-token prediction layers (DeepSeek-V3's MTP block) are the rows after the decoder's: megatron numbers the
MTP transformer layer i `num_layers + i + 1`, and the monitor labels it `mtp.i` (ModelTargets.label).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from mindspeed_proxy.monitor.mla_layout import is_mla, mla_weights


@dataclass
class WeightTarget:
    """One monitored 2-D weight: how to read it as [out, in] and how it is sharded."""

    layer: int
    slot: int
    name: str
    read: Callable[[], torch.Tensor]  # returns the current weight as [out, in] (a view where possible)
    parallel_mode: Optional[str]  # "column", "row" or None (replicated)
    expert_parallel: bool = False  # lives on one EP rank; sharded over the expert-TP group


@dataclass
class AttentionTarget:
    """The fused QKV projection (and q/k norm scales) of one attention layer, or the projections of an MLA one."""

    layer: int
    module: torch.nn.Module
    read_qkv: Optional[Callable[[], torch.Tensor]]  # same precision source as the ΔW target of linear_qkv
    mla: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)  # MLA: role -> reader (mla_layout)


@dataclass
class ModelTargets:
    """All targets of this rank, plus the global shape every rank shares."""

    num_layers: int
    num_heads: int
    num_experts: int
    topk: int
    slots: list[str]
    weights: list[WeightTarget] = field(default_factory=list)
    attention: list[AttentionTarget] = field(default_factory=list)
    routers: dict[int, torch.nn.Module] = field(default_factory=dict)
    num_decoder_layers: Optional[int] = None  # rows from here on are MTP layers (None: num_layers)

    def label(self, layer):
        """The published name of table row `layer`: the global decoder layer, or `mtp.N` for an MTP layer."""
        first = self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers
        return f"mtp.{layer - first}" if isinstance(layer, int) and layer >= first else layer


def sampled_experts(num_experts: int, count: int) -> list[int]:
    """`count` global expert ids spread evenly over [0, num_experts)."""
    count = max(0, min(count, num_experts))
    return sorted({(i * num_experts) // count for i in range(count)}) if count else []


def main_param_map(optimizer) -> dict[int, torch.Tensor]:
    """id(model param) -> full fp32 main param, for optimizers that keep one (Float16Optimizer)."""
    mapping: dict[int, torch.Tensor] = {}
    if optimizer is None:
        return mapping
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        halves, mains = getattr(opt, "float16_groups", None), getattr(opt, "fp32_from_float16_groups", None)
        if halves is None or mains is None:
            continue
        for half_group, main_group in zip(halves, mains):
            for half, main in zip(half_group, main_group):
                if main.shape == half.shape:
                    mapping[id(half)] = main
    return mapping


def _decoder_layers(chunk: torch.nn.Module):
    """The chunk's decoder layers, then the transformer layers of its multi-token prediction block (if any)."""
    while not hasattr(chunk, "decoder"):
        chunk = chunk.module
    mtp = getattr(chunk, "mtp", None)
    return list(chunk.decoder.layers) + ([m.transformer_layer for m in mtp.layers] if mtp is not None else [])


def collect(model_chunks, config, matrices: list[str], experts_per_layer: int, optimizer=None,
            layers: Optional[list[int]] = None) -> ModelTargets:
    """Discover this rank's monitored weights in `model_chunks` (megatron GPT models, any wrapper)."""
    from megatron.core import parallel_state as ps

    num_experts = config.num_moe_experts or 0
    expert_ids = sampled_experts(num_experts, experts_per_layer) if "experts" in matrices else []
    slots = ["linear_qkv", "linear_proj", "router", "mlp.fc1", "mlp.fc2"]
    slots += [f"expert{e}.{fc}" for e in expert_ids for fc in ("fc1", "fc2")]
    mtp_layers = getattr(config, "mtp_num_layers", None) or 0
    targets = ModelTargets(num_layers=config.num_layers + mtp_layers, num_heads=config.num_attention_heads,
                           num_experts=num_experts, topk=config.moe_router_topk or 0, slots=slots,
                           num_decoder_layers=config.num_layers)
    mains = main_param_map(optimizer)

    def reader(param, transpose=False, view=None):
        source = mains.get(id(param), param)

        def read():
            w = source if view is None else view(source)
            return w.t() if transpose else w
        return read

    def add(layer, slot_name, param, mode, transpose=False, view=None, expert=False):
        slot = slots.index(slot_name)
        targets.weights.append(WeightTarget(layer, slot, slot_name, reader(param, transpose, view), mode, expert))

    ep_rank = ps.get_expert_model_parallel_rank()
    for chunk in model_chunks:
        for module in _decoder_layers(chunk):
            layer = module.layer_number - 1
            if layers is not None and layer not in layers:
                continue
            attn = getattr(module, "self_attention", None)
            if attn is not None and is_mla(attn):
                readers = {role: reader(p) for role, p in mla_weights(attn).items()}
                targets.attention.append(AttentionTarget(layer, attn, None, readers))
                if "linear_proj" in matrices:
                    add(layer, "linear_proj", attn.linear_proj.weight, "row")
            elif attn is not None and hasattr(attn, "linear_qkv"):
                targets.attention.append(AttentionTarget(layer, attn, reader(attn.linear_qkv.weight)))
                if "linear_qkv" in matrices:
                    add(layer, "linear_qkv", attn.linear_qkv.weight, "column")
                if "linear_proj" in matrices:
                    add(layer, "linear_proj", attn.linear_proj.weight, "row")
            mlp = module.mlp
            router = getattr(mlp, "router", None)
            if router is not None:
                targets.routers[layer] = router
                if "router" in matrices:
                    add(layer, "router", router.weight, None)
            dense = getattr(mlp, "shared_experts", None) if router is not None else mlp
            if dense is not None and hasattr(dense, "linear_fc1") and "dense_mlp" in matrices:
                add(layer, "mlp.fc1", dense.linear_fc1.weight, "column")
                add(layer, "mlp.fc2", dense.linear_fc2.weight, "row")
            experts = getattr(mlp, "experts", None)
            if experts is None or not expert_ids:
                continue
            n_local = experts.num_local_experts
            for global_id in expert_ids:
                local = global_id - ep_rank * n_local
                if not 0 <= local < n_local:
                    continue
                if hasattr(experts, "local_experts"):
                    fc = experts.local_experts[local]
                    add(layer, f"expert{global_id}.fc1", fc.linear_fc1.weight, "column", expert=True)
                    add(layer, f"expert{global_id}.fc2", fc.linear_fc2.weight, "row", expert=True)
                elif hasattr(experts, "weight1"):  # legacy GroupedMLP: expert i is weight.view(n, ...)[i]
                    hidden = config.hidden_size
                    add(layer, f"expert{global_id}.fc1", experts.weight1, "column", transpose=True,
                        view=lambda w, i=local: w.view(n_local, hidden, -1)[i], expert=True)
                    add(layer, f"expert{global_id}.fc2", experts.weight2, "row", transpose=True,
                        view=lambda w, i=local: w.view(n_local, -1, hidden)[i], expert=True)
    return targets
