"""Read a torch_dist checkpoint (megatron-core `dist_checkpointing`) by global tensor and write a proxy of it.

The source is read through torch.distributed.checkpoint metadata (global keys, shapes, stored chunks): the
`weights` features and router rows chunk by chunk, memory-mapped (chunks.ChunkReader); only the
`outputs` features (and chunkings that are not a grid over the experts) read layer slabs `[1, E, ...]`
through megatron-core's TorchDist load strategy. The model is never built. The proxy is written with `dist_checkpointing.save` from a
single gloo process: the same global keys, the expert axis (axis 1 of the stacked expert and router
tensors) cut from E to K, expert `_extra_state` objects renumbered, optimizer and RNG entries dropped.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.core.keys import (
    _PER_LAYER_MOE,
    EXPERTS,
    MTP_MLP,
    ROUTER,
    expert_axis,
    is_mtp_moe,
    is_sliced,
    is_stacked,
    key_layer,
    stacked_name,
)
from mindspeed_proxy.proxy.core.layout import Layout, layout_from_args
from mindspeed_proxy.proxy.core.plan_types import rewrite_args
from mindspeed_proxy.proxy.core.refs import LayerRef, id_order
from mindspeed_proxy.proxy.core.tracker import resolve_iteration
from mindspeed_proxy.proxy.io.dist.chunks import ChunkReader, layer_row_groups
from mindspeed_proxy.proxy.io.dist.group import close_group
from mindspeed_proxy.proxy.io.dist.index import DistIndex, read_regions, slab_request, whole_request


class DistCheckpoint:
    """One iteration of a torch_dist checkpoint, validated against the `args` in its common state."""

    format = "torch_dist"
    chunks = ["model"]

    def __init__(self, root: str, iteration: Optional[int] = None, trust: bool = False):
        self.root, self.trust = root, trust
        self.iteration, self.folder = resolve_iteration(root, iteration)
        self.index = DistIndex(self.folder, trust)
        common = self.index.common
        if "args" not in common:
            raise ConversionError(f"{self.folder}: no 'args' recorded in its common state")
        self.args = common["args"]
        self.layout = layout_from_args(self.args)
        routers = sorted(k for k in self.index.tensors if k.endswith("mlp.router.weight"))
        mtp = sorted((k for k in routers if is_mtp_moe(k)), key=lambda k: id_order(key_layer(k)))
        routers = [k for k in routers if k not in mtp]
        unknown = [k for k in routers if k != ROUTER + "weight" and not _PER_LAYER_MOE.match(k)]
        if unknown:
            raise ConversionError(f"{self.folder}: unknown expert layout: router {unknown[0]!r} outside "
                                  "decoder.layers and mtp.layers.N.transformer_layer is not supported")
        if not routers:
            raise ConversionError(f"--load {root}: no MoE layer ({ROUTER}weight or decoder.layers.N.mlp.router."
                                  "weight missing) in the torch_dist checkpoint")
        if ROUTER + "weight" in routers and len(routers) > 1:
            raise ConversionError(f"{self.folder}: unknown expert layout: both stacked {ROUTER}weight and "
                                  f"per-layer {routers[0]!r}")
        self.per_layer = ROUTER + "weight" not in routers
        if self.per_layer:  # non-homogeneous layers (moe_layer_freq, hetero specs): one key per layer
            moe = sorted(key_layer(k) for k in routers)
        else:
            moe = self.index.layers_of[ROUTER + "weight"]
        sliced = [k for k in self.index.tensors if is_sliced(k)]
        self.sliced = {l: sorted(k for k in sliced if (key_layer(k) == l if self.per_layer else is_stacked(k)))
                       for l in moe}
        # multi-token prediction layers: per-layer keys whatever the decoder's form
        self.sliced.update({key_layer(k): sorted(s for s in sliced if key_layer(s) == key_layer(k)) for k in mtp})
        self._check_sliced(moe, [key_layer(k) for k in mtp])
        self.expert_keys = sorted(stacked_name(k) for k in self.sliced[moe[0]] if stacked_name(k).startswith(EXPERTS))
        self.layers = [LayerRef(0, "model", f"decoder.layers.{l}.mlp.", l) for l in moe] + [
            LayerRef(0, "model", MTP_MLP.match(k).group(0), None, int(MTP_MLP.match(k).group(1))) for k in mtp]
        self._cache: dict = {}
        self._reader = None

    def _per_layer(self, layer: LayerRef) -> bool:
        """True when `layer`'s tensors have one key per layer (no layer axis)."""
        return self.per_layer or layer.mtp is not None

    def _check_sliced(self, moe: list, mtp: list) -> None:
        E, names = self.layout.num_experts, None
        for l in moe + mtp:
            layer_names = sorted(stacked_name(k) for k in self.sliced[l])
            if not any(n.startswith(EXPERTS) for n in layer_names):
                raise ConversionError(f"{self.folder}: unknown expert layout: no {EXPERTS}* tensors"
                                      + (f" for layer {l}" if self.per_layer or l in mtp else ""))
            if names is not None and layer_names != names:
                raise ConversionError(f"{self.folder}: MoE layer {l} stores {layer_names}, layer {moe[0]} {names}")
            names = layer_names
            for key in self.sliced[l]:
                shape, axis = self.index.tensors[key][0], expert_axis(key)
                if len(shape) <= axis or shape[axis] != E:
                    want = f"[L, {E}, ...]" if axis else f"[{E}, ...]"
                    raise ConversionError(f"{self.folder}: {key} has global shape {list(shape)}, expected {want} "
                                          f"for args num_experts = {E} (inconsistent experts between files and args)")
                if is_stacked(key) and self.index.layers_of[key] != moe:
                    raise ConversionError(f"{self.folder}: {key} is stored for layers {self.index.layers_of[key]}, "
                                          f"the router for {moe}")

    def layer_slabs(self, layer: LayerRef) -> dict:
        """{stacked key name: [E, ...] tensor} of the expert and router tensors of `layer` (cached until
        release); per-layer keys are reported under their stacked names."""
        if layer not in self._cache:
            keys = self.sliced[layer.id]
            if self._per_layer(layer):
                requests = {k: whole_request(k, *self.index.tensors[k]) for k in keys}
                slabs = {stacked_name(k): v for k, v in read_regions(self.folder, requests).items()}
            else:
                requests = {k: slab_request(k, *self.index.tensors[k], layer.global_layer) for k in keys}
                slabs = {k: v[0] for k, v in read_regions(self.folder, requests).items()}
            self._cache = {layer: slabs}
        return self._cache[layer]

    def expert(self, layer: LayerRef, global_id: int, tp: int) -> dict:
        """{'linear_fc1.weight': tensor, ...} of expert `global_id` (whole, all TP pieces; {} for tp > 0)."""
        if tp:
            return {}
        return {k[len(EXPERTS + "experts."):] if k.startswith(EXPERTS + "experts.") else k[len(EXPERTS):]: v[global_id]
                for k, v in self.layer_slabs(layer).items() if k.startswith(EXPERTS)}

    def router(self, layer: LayerRef) -> dict:
        """{'weight': [E, H], 'expert_bias'?: [E], 'bias'?: [E]} of `layer` (only the router's chunks read)."""
        if layer in self._cache:
            return {k[len(ROUTER):]: v for k, v in self._cache[layer].items() if k.startswith(ROUTER)}
        reader, out = self.chunk_reader(), {}
        for key in self.sliced[layer.id]:
            name = stacked_name(key)
            if name.startswith(ROUTER):
                shape = self.index.tensors[key][0]
                if self._per_layer(layer):
                    out[name[len(ROUTER):]] = reader.region(key, (0,) * len(shape), shape).clone()
                else:
                    start = (layer.global_layer,) + (0,) * (len(shape) - 1)
                    out[name[len(ROUTER):]] = reader.region(key, start, (1,) + tuple(shape[1:]))[0].clone()
        reader.forget()
        return out

    def chunk_reader(self):
        """A ChunkReader over this iteration's folder (created once)."""
        if self._reader is None:
            self._reader = ChunkReader(self.folder)
        return self._reader

    def expert_row_groups(self, layer: LayerRef):
        """Lists of E tensors (one per expert) whose Grams sum to `layer`'s expert-weight Gram, one list per
        stored chunk region, memory-mapped one region at a time; a key whose chunks do not tile the
        experts as a grid is read as a layer slab instead."""
        E = self.layout.num_experts
        for key in self.sliced[layer.id]:
            if not stacked_name(key).startswith(EXPERTS):
                continue
            groups = layer_row_groups(self.chunk_reader(), key, None if self._per_layer(layer) else layer.global_layer,
                                      E)
            if groups is None:
                slab = self.layer_slabs(layer)[stacked_name(key)]
                groups = [[slab[e] for e in range(E)]]
            yield from groups

    def rewrite_config(self, target: Layout) -> tuple:
        """A copy of the common args with Megatron's expert/world fields for `target`, and the diff."""
        return rewrite_args(self.args, target)

    def release(self) -> None:
        """Drop the cached layer."""
        self._cache = {}
        if self._reader is not None:
            self._reader.forget()

    def close(self) -> None:
        """Release caches and the process group this reader created."""
        self.release()
        self._reader = None
        close_group()

    def file_paths(self) -> list:
        """Every file of this iteration (for hashing), sorted."""
        return sorted(os.path.join(self.folder, n) for n in os.listdir(self.folder))

    def bytes_to_write(self, plan) -> int:
        """Tensor bytes of the proxy's model entries."""
        total = 0
        for key, (shape, dtype) in self.index.tensors.items():
            shape = list(shape)
            if is_sliced(key):
                shape[expert_axis(key)] = plan.target.num_experts
            numel = 1
            for s in shape:
                numel *= s
            if is_stacked(key):
                numel = numel // shape[0] * len(self.index.layers_of[key])
            total += numel * torch.empty((), dtype=dtype).element_size()
        return total
