"""Which weights of a Hugging Face MoE model the host monitor watches, found through the converter's family table.

The model families and the name of their MoE block come from `mindspeed_proxy.proxy.io.hf.layout.ARCHITECTURES`
(one table for the converter and this host), resolved from `model.config.model_type`. Per decoder layer:

- attention (`self_attn`): `q_proj`, `k_proj`, `v_proj`, `o_proj` ([out, in] nn.Linear weights, heads of
  `head_dim` rows, GQA by `num_key_value_heads`) and the per-head q/k RMSNorm scales `q_norm` / `k_norm`
  (Qwen3) when present;
- the router: the MoE block's `gate` (`weight` [E, H]); softmax families pass its logits to the router
  statistics, sigmoid ones (DeepSeek-V3, `scoring_func: sigmoid`) log σ(logits), whose softmax is the
  normalised affinity σ/Σσ; the selected experts come from the gate's output (correction bias included);
- experts: fused (`experts.gate_up_proj` [E, 2F, H], `experts.down_proj` [E, H, F], transformers' in-memory
  layout) or per expert (`experts.{i}.{gate,up,down}_proj` / Mixtral's `w1,w3,w2`); the shared expert
  (`shared_expert` / `shared_experts`) or a dense MLP as `mlp.fc1` / `mlp.fc2`.

Slots carry megatron-core's names so the detectors, `report` and `compare` read both hosts alike:
`linear_qkv` = [q; k; v] stacked rows (the same singular values as megatron's fused weight), `linear_proj` =
`o_proj`, `router`, `mlp.fc1` = [gate; up], `mlp.fc2` = down, `expert{e}.fc1/fc2`.

A decoder layer's MoE block may instead hold a DeepSpeed-MoE layer (`deepspeed.moe.layer.MoE`, found by its
`deepspeed_moe` attribute): its router is `deepspeed_moe.gate` (a TopKGate, weight `gate.wg.weight`), its
experts the `num_experts / ep_size` local ones of this expert-parallel rank (`experts.deepspeed_experts`,
global index ep_rank·local + i); only those get expert slots here (`Slot.expert_parallel`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from mindspeed_proxy.monitor.targets import sampled_experts
from mindspeed_proxy.proxy.io.hf import layout as hf_layout
from mindspeed_proxy.proxy.core.errors import ConversionError

BASE_SLOTS = ["linear_qkv", "linear_proj", "router", "mlp.fc1", "mlp.fc2"]
SLOT_MATRIX = {"linear_qkv": "linear_qkv", "linear_proj": "linear_proj", "router": "router",
               "mlp.fc1": "dense_mlp", "mlp.fc2": "dense_mlp"}  # slot -> update_matrices entry


@dataclass
class Slot:
    """One monitored matrix: rows stacked from views of full parameters (each a function of the full tensor)."""

    index: int
    name: str
    parts: list  # [(param, view: full tensor -> [rows, in])]
    expert_parallel: bool = False  # a DeepSpeed-MoE expert held by this EP rank only

    def read(self, full: Callable[[torch.nn.Parameter], torch.Tensor]) -> torch.Tensor:
        """The [out, in] matrix from the full parameters that `full` returns."""
        mats = [view(full(p)) for p, view in self.parts]
        return mats[0] if len(mats) == 1 else torch.cat(mats, dim=0)


@dataclass
class Attention:
    """The q/k projections and per-head norms of one attention layer."""

    q: torch.nn.Parameter
    k: torch.nn.Parameter
    q_norm: Optional[torch.nn.Parameter]
    k_norm: Optional[torch.nn.Parameter]
    num_heads: int
    num_kv: int
    head_dim: int


@dataclass
class Layer:
    """What the monitor reads of one decoder layer (0-based `index`)."""

    index: int
    slots: list = field(default_factory=list)
    attention: Optional[Attention] = None
    gate: Optional[torch.nn.Module] = None
    deepspeed_moe: bool = False  # the gate is DeepSpeed's TopKGate (logits recomputed from its input)

    def params(self) -> list:
        """Every parameter this layer's statistics read (each once), in a fixed order."""
        seen, out = set(), []
        tensors = [p for s in self.slots for p, _ in s.parts]
        if self.attention is not None:
            a = self.attention
            tensors += [t for t in (a.q, a.k, a.q_norm, a.k_norm) if t is not None]
        for p in tensors:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out


@dataclass
class HFTargets:
    """All monitored layers of a Hugging Face model and the global shape every rank shares."""

    model_type: str
    num_layers: int
    num_heads: int
    num_experts: int
    topk: int
    sigmoid: bool
    slots: list
    layers: list
    routers: dict  # {layer: module whose `weight` is the router's [E, H]}
    ep_group: object = None  # DeepSpeed-MoE's expert-parallel group (None: experts whole on every rank)
    ep_size: int = 1

    @staticmethod
    def label(layer):
        """The published name of table row `layer` (Hugging Face models here have no MTP rows)."""
        return layer


def _whole(t):
    return t


def _expert_row(i):
    return lambda t: t[i]


def _decoder_layers(model: torch.nn.Module):
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder `layers` ModuleList under `.model`")
    return layers


def _expert_parts(experts, e: int) -> tuple:
    """(fc1 parts, fc2 parts) of expert `e`: fused tensors or per-expert modules."""
    if hasattr(experts, "gate_up_proj"):
        return [(experts.gate_up_proj, _expert_row(e))], [(experts.down_proj, _expert_row(e))]
    mod = experts[e]
    if hasattr(mod, "w1"):  # Mixtral per-expert: w1 gate, w3 up, w2 down
        return [(mod.w1.weight, _whole), (mod.w3.weight, _whole)], [(mod.w2.weight, _whole)]
    return [(mod.gate_proj.weight, _whole), (mod.up_proj.weight, _whole)], [(mod.down_proj.weight, _whole)]


def deepspeed_moe_of(block) -> Optional[torch.nn.Module]:
    """The DeepSpeed-MoE layer (`deepspeed.moe.layer.MoE`) that `block` is or directly holds, else None."""
    if block is None:
        return None
    if hasattr(block, "deepspeed_moe"):
        return block
    return next((m for m in block.children() if hasattr(m, "deepspeed_moe")), None)


def _ds_expert_parts(moe, e: int) -> tuple:
    """(fc1 parts, fc2 parts) of local expert `e` of a DeepSpeed-MoE layer (gate/up/down or w1/w3/w2 Linears)."""
    expert = moe.deepspeed_moe.experts.deepspeed_experts[e]
    if not (hasattr(expert, "w1") or all(hasattr(expert, n) for n in ("gate_proj", "up_proj", "down_proj"))):
        raise ValueError(f"DeepSpeed-MoE expert {type(expert).__name__}: expected gate_proj/up_proj/down_proj "
                         f"or w1/w3/w2 Linear layers")
    return _expert_parts(moe.deepspeed_moe.experts.deepspeed_experts, e)


def _ds_group(moe):
    """(EP group, EP rank, EP size) of a DeepSpeed-MoE layer (set by deepspeed.initialize)."""
    size = moe.ep_size
    if size == 1:
        return None, 0, 1
    import torch.distributed as dist

    group = getattr(moe.deepspeed_moe, "ep_group", None)
    if group is None:
        raise ValueError("DeepSpeed-MoE layer with ep_size > 1 has no expert-parallel group "
                         "(attach the monitor after deepspeed.initialize)")
    return group, dist.get_rank(group), size


def _mlp_parts(mlp) -> Optional[tuple]:
    if mlp is None or not hasattr(mlp, "down_proj"):
        return None
    return [(mlp.gate_proj.weight, _whole), (mlp.up_proj.weight, _whole)], [(mlp.down_proj.weight, _whole)]


def collect(model: torch.nn.Module, matrices, experts_per_layer: int, layers=None) -> HFTargets:
    """The monitored layers of `model` (a transformers *ForCausalLM of a family in hf_layout.ARCHITECTURES)."""
    config = model.config
    where = f"{type(model).__name__} (model_type {getattr(config, 'model_type', None)!r})"
    try:
        arch = hf_layout.architecture(config.to_dict(), where)
        num_experts = hf_layout.expert_count(config.to_dict(), where)
    except ConversionError as exc:
        raise ValueError(str(exc)) from None
    expert_ids = sampled_experts(num_experts, experts_per_layer) if "experts" in matrices else []
    slots = BASE_SLOTS + [f"expert{e}.{fc}" for e in expert_ids for fc in ("fc1", "fc2")]
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    out = HFTargets(config.model_type, config.num_hidden_layers, num_heads, num_experts,
                    config.num_experts_per_tok, getattr(config, "scoring_func", "softmax") == "sigmoid",
                    slots, [], {})

    def add(layer, name, parts):
        if SLOT_MATRIX.get(name, "experts") in matrices:
            layer.slots.append(Slot(slots.index(name), name, parts))

    for index, module in enumerate(_decoder_layers(model)):
        if layers is not None and index not in layers:
            continue
        layer = Layer(index)
        attn = getattr(module, "self_attn", None)
        if attn is not None and hasattr(attn, "o_proj"):
            add(layer, "linear_proj", [(attn.o_proj.weight, _whole)])
        if attn is not None and all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")):  # not MLA
            add(layer, "linear_qkv", [(attn.q_proj.weight, _whole), (attn.k_proj.weight, _whole),
                                      (attn.v_proj.weight, _whole)])
            norm = [getattr(getattr(attn, n, None), "weight", None) for n in ("q_norm", "k_norm")]
            layer.attention = Attention(attn.q_proj.weight, attn.k_proj.weight, *norm, num_heads,
                                        config.num_key_value_heads, head_dim)
        block = next((getattr(module, b) for b in arch.blocks if hasattr(module, b)), None)
        gate = getattr(block, "gate", None)
        moe = deepspeed_moe_of(block)
        if moe is not None:
            _add_deepspeed_moe(out, layer, moe, expert_ids, add)
            dense = None
        elif gate is not None and hasattr(block, "experts"):
            layer.gate = gate
            out.routers[index] = gate
            add(layer, "router", [(gate.weight, _whole)])
            shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
            dense = _mlp_parts(shared)
            for e in expert_ids:
                fc1, fc2 = _expert_parts(block.experts, e)
                add(layer, f"expert{e}.fc1", fc1)
                add(layer, f"expert{e}.fc2", fc2)
        else:
            dense = _mlp_parts(block)
        if dense is not None:
            add(layer, "mlp.fc1", dense[0])
            add(layer, "mlp.fc2", dense[1])
        out.layers.append(layer)
    return out


def _add_deepspeed_moe(out: HFTargets, layer: Layer, moe, expert_ids, add) -> None:
    """The router and this EP rank's sampled experts of one DeepSpeed-MoE layer."""
    if moe.num_experts != out.num_experts:
        raise ValueError(f"DeepSpeed-MoE layer {layer.index}: {moe.num_experts} experts, config says "
                         f"{out.num_experts}")
    group, ep_rank, ep_size = _ds_group(moe)
    if out.ep_group is not None and out.ep_size != ep_size:
        raise ValueError(f"DeepSpeed-MoE layer {layer.index}: ep_size {ep_size}, an earlier layer has "
                         f"{out.ep_size} (one expert-parallel size per model is supported)")
    out.ep_group, out.ep_size = group, ep_size
    gate = moe.deepspeed_moe.gate
    layer.gate, layer.deepspeed_moe = gate, True
    out.routers[layer.index] = gate.wg
    add(layer, "router", [(gate.wg.weight, _whole)])
    local = moe.num_local_experts
    for e in expert_ids:
        if ep_rank * local <= e < (ep_rank + 1) * local:
            fc1, fc2 = _ds_expert_parts(moe, e - ep_rank * local)
            n = len(layer.slots)
            add(layer, f"expert{e}.fc1", fc1)
            add(layer, f"expert{e}.fc2", fc2)
            for slot in layer.slots[n:]:
                slot.expert_parallel = ep_size > 1  # ep_size 1: whole experts, owned like the rest of the layer


@torch.no_grad()
def qk_blocks(weights: dict, a: Attention) -> tuple:
    """Query blocks [G, n/G, d, h] and key blocks [G, 1, d, h] (G = KV heads), q/k norm scales folded in.

    `weights` maps each of a's parameters to its full fp32 value (None norms: no scale)."""
    h, g = a.head_dim, a.num_kv
    wq = weights[a.q].view(a.num_heads, h, -1)
    wk = weights[a.k].view(g, h, -1)
    if a.q_norm is not None:
        wq = wq * weights[a.q_norm].view(1, h, 1)
    if a.k_norm is not None:
        wk = wk * weights[a.k_norm].view(1, h, 1)
    wq = wq.transpose(1, 2).reshape(g, a.num_heads // g, wq.shape[-1], h)
    return wq, wk.transpose(1, 2).unsqueeze(1)
