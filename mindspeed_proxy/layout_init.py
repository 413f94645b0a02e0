"""Layout-independent weight initialisation, so models at different TP/EP/PP sizes hold the same weights.

Megatron's CPU initialisation is TP-invariant but not EP-invariant: every EP rank draws its local
experts from the same generator position, so expert i and expert i + E/EP start identical.
`global_init` draws every logical (global) tensor from a generator seeded by (seed, global name) and
keeps only this rank's shard, so a model at EP=2/TP=2 holds exactly the weights of the same model at
EP=1/TP=1, with distinct experts. Output projections (linear_proj, fc2) get std / sqrt(2·layers), as
Megatron's scaled init does.
"""
from __future__ import annotations

import math
import re
import zlib

import torch

_LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")
_GROUPED = re.compile(r"experts\.weight([12])$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight", "experts.weight2")


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def _take_shard(full: torch.Tensor, dim: int, stride: int, rank: int, world: int) -> torch.Tensor:
    """Rank's shard of `full` along `dim`, interleaved `stride` ways as Megatron's strided split."""
    pieces = torch.split(full, full.shape[dim] // (world * stride), dim=dim)
    return torch.cat(pieces[rank::world], dim=dim)


def _draw(shape, seed, name, std):
    return torch.randn(shape, generator=_generator(seed, name), dtype=torch.float32) * std


@torch.no_grad()
def global_init(model: torch.nn.Module, seed: int = 1234, std: float = 0.02) -> None:
    """Re-initialise every >=2-D parameter of `model` from its global name; 1-D params are kept."""
    from megatron.core import parallel_state as ps

    num_layers = _find_decoder(model).config.num_layers
    scaled_std = std / math.sqrt(2.0 * num_layers)

    ep_rank, ep = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    etp = ps.get_expert_tensor_parallel_world_size()
    for name, param in model.named_parameters():
        if param.dim() < 2:
            continue
        name = _global_layer_name(model, name.removeprefix("module."))
        is_expert = not getattr(param, "allreduce", True)
        rank, world = (etp_rank, etp) if is_expert else (tp_rank, tp)
        sharded = getattr(param, "tensor_model_parallel", False) and world > 1
        dim = getattr(param, "partition_dim", 0)
        stride = getattr(param, "partition_stride", 1)
        full_shape = list(param.shape)
        if sharded:
            full_shape[dim] *= world
        param_std = scaled_std if name.endswith(_OUTPUT_PROJECTIONS) else std
        grouped = _GROUPED.search(name)
        if grouped:
            n_local = _num_local_experts(model, name)
            per_expert = list(full_shape)
            per_expert[dim] //= n_local
            blocks = [
                _take_shard(_draw(per_expert, seed, f"{name}[{ep_rank * n_local + i}]", param_std),
                            dim, stride, rank, world) if sharded
                else _draw(per_expert, seed, f"{name}[{ep_rank * n_local + i}]", param_std)
                for i in range(n_local)
            ]
            # GroupedMLP's expert i is weight.view(n, ...)[i]: a memory block, not a column slice.
            value = torch.stack(blocks).reshape(param.shape)
        else:
            match = _LOCAL_EXPERT.search(name)
            if match and ep > 1:
                n_local = _num_local_experts(model, name)
                global_id = ep_rank * n_local + int(match.group(1))
                name = name.replace(match.group(0), f"local_experts.{global_id}.")
            value = _draw(full_shape, seed, name, param_std)
            if sharded:
                value = _take_shard(value, dim, stride, rank, world)
        param.copy_(value.to(param.dtype))


def _global_layer_name(model: torch.nn.Module, name: str) -> str:
    """Rename the pipeline-stage-local `decoder.layers.i.` to the global layer index."""
    match = _LAYER.match(name)
    if not match:
        return name
    layer = _find_decoder(model).layers[int(match.group(1))]
    return f"decoder.layers.{layer.layer_number - 1}." + name[match.end():]


def _find_decoder(model: torch.nn.Module) -> torch.nn.Module:
    while not hasattr(model, "decoder"):
        model = model.module
    return model.decoder


def _num_local_experts(model: torch.nn.Module, name: str) -> int:
    """Experts per EP rank of any MoE layer, decoder or multi-token prediction (`mtp.layers.i.`)."""
    from megatron.core import parallel_state as ps

    return _find_decoder(model).config.num_moe_experts // ps.get_expert_model_parallel_world_size()

