"""Read a torch_dist checkpoint (megatron-core `dist_checkpointing`) by global tensor and write a proxy of it.

The source is read through torch.distributed.checkpoint metadata (global keys, shapes, stored chunks): the
`weights` features and router rows chunk by chunk, memory-mapped (dist_chunks.ChunkReader); only the
`outputs` features (and chunkings that are not a grid over the experts) read layer slabs `[1, E, ...]`
through megatron-core's TorchDist load strategy. The model is never built. The proxy is written with `dist_checkpointing.save` from a
single gloo process: the same global keys, the expert axis (axis 1 of the stacked expert and router
tensors) cut from E to K, expert `_extra_state` objects renumbered, optimizer and RNG entries dropped.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from typing import Optional

import torch

from mindspeed_proxy.proxy.io.dist.common import is_common_record, read_common
from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.core.layout import layout_from_args
from mindspeed_proxy.proxy.io.legacy.checkpoint import TRACKER, MoELayer, iteration_dir_name, resolve_iteration

KEPT_COMMON = ("args", "checkpoint_version", "iteration", "opt_param_scheduler",
               "num_floating_point_operations_so_far", "content_metadata")
STACKED = "decoder.layers."
EXPERTS = "decoder.layers.mlp.experts."
ROUTER = "decoder.layers.mlp.router."
_OBJECT = re.compile(r"^(.+)/shard_([\d.]+)_([\d.]+)$")
_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_PER_LAYER_MOE = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.(experts|router)\.")
_OWN_GROUP = []


def ensure_group() -> None:
    """A world-1 gloo process group for megatron's dist_checkpointing (created once, if none exists)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ConversionError("torch_dist conversion runs in a single process (world size 1)")
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _OWN_GROUP.append(True)


def close_group() -> None:
    """Destroy the process group if ensure_group() created it."""
    import torch.distributed as dist

    if _OWN_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWN_GROUP.clear()


def is_model_key(key: str) -> bool:
    """True for model entries (not optimizer state, RNG or rerun-state-machine records: megatron-core 0.19
    saves the latter always, per source rank, and Megatron-LM's --finetune load does not ask for it; nor the
    per-rank checkpoint parts of our RL loop, e.g. its reference policy: training/checkpoint_parts.py)."""
    return not key.startswith(("optimizer.", "rng_state", "rerun_state_machine_state", "checkpoint_parts."))


def is_stacked(key: str) -> bool:
    """True for `decoder.layers.*` keys stored with a leading layer axis (megatron's homogeneous layers)."""
    return key.startswith(STACKED) and not _PER_LAYER.match(key)


def key_layer(key: str) -> Optional[int]:
    """Global layer of a per-layer key `decoder.layers.{l}.*` (non-homogeneous layers), else None."""
    match = _PER_LAYER.match(key)
    return int(match.group(1)) if match else None


def is_sliced(key: str) -> bool:
    """True for tensors/objects with an expert axis: routed experts and router rows, stacked or per layer."""
    return key.startswith((EXPERTS, ROUTER)) or bool(_PER_LAYER_MOE.match(key))


def expert_axis(key: str) -> int:
    """The expert axis of a sliced key: 1 after the layer axis of a stacked key, else 0."""
    return 1 if is_stacked(key) else 0


def stacked_name(key: str) -> str:
    """`decoder.layers.{l}.mlp.X` -> `decoder.layers.mlp.X` (the name of the same tensor when stacked)."""
    return _PER_LAYER.sub(STACKED, key, count=1)


def _dots(text: str) -> tuple:
    return tuple(int(x) for x in text.split("."))


def read_regions(folder: str, requests: dict) -> dict:
    """{name: tensor or object} for ShardedTensor / ShardedObject `requests`, read with megatron's
    TorchDist load strategy; ConversionError if the files cannot deliver them."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    ensure_group()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return TorchDistLoadShardedStrategy().load(requests, folder)
    except Exception as exc:  # torch / megatron raise many types for damaged files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConversionError(f"truncated or unreadable shard in {folder}: {first}") from None


def slab_request(key: str, shape: tuple, dtype, layer: int):
    """ShardedTensor asking for layer `layer` of stacked global tensor `key` (shape [L, ...])."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor.from_rank_offsets(key, torch.empty((1,) + tuple(shape[1:]), dtype=dtype),
                                           (0, layer, shape[0]))


def whole_request(key: str, shape: tuple, dtype):
    """ShardedTensor asking for all of global tensor `key`."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor.from_rank_offsets(key, torch.empty(tuple(shape), dtype=dtype))


class DistIndex:
    """What a torch_dist folder holds: common state, model tensor keys with shapes, layers per stacked key,
    sharded objects; files checked against the metadata (missing or truncated .distcp refused)."""

    def __init__(self, folder: str, trust: bool = False):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.folder = folder
        try:
            info = json.load(open(os.path.join(folder, "metadata.json"), encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConversionError(f"{folder}: unreadable metadata.json ({exc})") from None
        if info.get("sharded_backend") != "torch_dist":
            raise ConversionError(f"{folder}: sharded_backend {info.get('sharded_backend')!r} is not torch_dist")
        self.info = info
        if not os.path.isfile(os.path.join(folder, ".metadata")):
            raise ConversionError(f"{folder}: missing .metadata (incomplete torch_dist checkpoint)")
        try:
            meta = FileSystemReader(folder).read_metadata()
        except Exception as exc:
            raise ConversionError(f"truncated or unreadable shard: {folder}: {exc}") from None
        ends: dict = {}
        for item in meta.storage_data.values():
            ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
        for name, end in sorted(ends.items()):
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                raise ConversionError(f"missing shard {path} (listed in .metadata)")
            if os.path.getsize(path) < end:
                raise ConversionError(f"truncated or unreadable shard: {path} has {os.path.getsize(path)} bytes, "
                                      f".metadata expects at least {end}")
        try:
            self.common = read_common(folder, meta, trust)
        except ValueError as exc:
            raise ConversionError(str(exc)) from None
        self.tensors, self.layers_of, self.objects = {}, {}, {}
        for key, item in meta.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                if not is_model_key(key):
                    continue
                self.tensors[key] = (tuple(item.size), item.properties.dtype)
                if is_stacked(key):
                    self.layers_of[key] = sorted({c.offsets[0] + i for c in item.chunks for i in range(c.sizes[0])})
            elif is_model_key(key) and not is_common_record(key):
                match = _OBJECT.match(key)
                if not match:
                    raise ConversionError(f"{folder}: unexpected non-tensor entry {key!r}")
                self.objects[key] = (match.group(1), _dots(match.group(3)), _dots(match.group(2)))

    def object_requests(self, names) -> dict:
        """ShardedObject requests for the stored objects `names`."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        return {n: ShardedObject(self.objects[n][0], None, self.objects[n][1], self.objects[n][2], replica_id=0)
                for n in names}


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
        unknown = [k for k in routers if k != ROUTER + "weight" and not _PER_LAYER_MOE.match(k)]
        if unknown:
            raise ConversionError(f"{self.folder}: unknown expert layout: router {unknown[0]!r} outside "
                                  "decoder.layers (e.g. multi-token-prediction layers) is not supported")
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
        self.sliced = {l: sorted(k for k in self.index.tensors if is_sliced(k) and
                                 (key_layer(k) == l if self.per_layer else True)) for l in moe}
        self._check_sliced(moe)
        self.expert_keys = sorted(stacked_name(k) for k in self.sliced[moe[0]] if stacked_name(k).startswith(EXPERTS))
        self.layers = [MoELayer(0, "model", f"decoder.layers.{l}.mlp.", l) for l in moe]
        self._cache: dict = {}
        self._reader = None

    def _check_sliced(self, moe: list) -> None:
        E, names = self.layout.num_experts, None
        for l in moe:
            layer_names = sorted(stacked_name(k) for k in self.sliced[l])
            if not any(n.startswith(EXPERTS) for n in layer_names):
                raise ConversionError(f"{self.folder}: unknown expert layout: no {EXPERTS}* tensors"
                                      + (f" for layer {l}" if self.per_layer else ""))
            if names is not None and layer_names != names:
                raise ConversionError(f"{self.folder}: MoE layer {l} stores {layer_names}, layer {moe[0]} {names}")
            names = layer_names
            for key in self.sliced[l]:
                shape, axis = self.index.tensors[key][0], expert_axis(key)
                if len(shape) <= axis or shape[axis] != E:
                    want = f"[L, {E}, ...]" if axis else f"[{E}, ...]"
                    raise ConversionError(f"{self.folder}: {key} has global shape {list(shape)}, expected {want} "
                                          f"for args num_experts = {E} (inconsistent experts between files and args)")
                if not self.per_layer and self.index.layers_of[key] != moe:
                    raise ConversionError(f"{self.folder}: {key} is stored for layers {self.index.layers_of[key]}, "
                                          f"the router for {moe}")

    def layer_slabs(self, layer: MoELayer) -> dict:
        """{stacked key name: [E, ...] tensor} of the expert and router tensors of `layer` (cached until
        release); per-layer keys are reported under their stacked names."""
        if layer not in self._cache:
            keys = self.sliced[layer.global_layer]
            if self.per_layer:
                requests = {k: whole_request(k, *self.index.tensors[k]) for k in keys}
                slabs = {stacked_name(k): v for k, v in read_regions(self.folder, requests).items()}
            else:
                requests = {k: slab_request(k, *self.index.tensors[k], layer.global_layer) for k in keys}
                slabs = {k: v[0] for k, v in read_regions(self.folder, requests).items()}
            self._cache = {layer: slabs}
        return self._cache[layer]

    def expert(self, layer: MoELayer, global_id: int, tp: int) -> dict:
        """{'linear_fc1.weight': tensor, ...} of expert `global_id` (whole, all TP pieces; {} for tp > 0)."""
        if tp:
            return {}
        return {k[len(EXPERTS + "experts."):] if k.startswith(EXPERTS + "experts.") else k[len(EXPERTS):]: v[global_id]
                for k, v in self.layer_slabs(layer).items() if k.startswith(EXPERTS)}

    def router(self, layer: MoELayer) -> dict:
        """{'weight': [E, H], 'expert_bias'?: [E], 'bias'?: [E]} of `layer` (only the router's chunks read)."""
        if layer in self._cache:
            return {k[len(ROUTER):]: v for k, v in self._cache[layer].items() if k.startswith(ROUTER)}
        reader, out = self.chunk_reader(), {}
        for key in self.sliced[layer.global_layer]:
            name = stacked_name(key)
            if name.startswith(ROUTER):
                shape = self.index.tensors[key][0]
                if self.per_layer:
                    out[name[len(ROUTER):]] = reader.region(key, (0,) * len(shape), shape).clone()
                else:
                    start = (layer.global_layer,) + (0,) * (len(shape) - 1)
                    out[name[len(ROUTER):]] = reader.region(key, start, (1,) + tuple(shape[1:]))[0].clone()
        reader.forget()
        return out

    def chunk_reader(self):
        """A ChunkReader over this iteration's folder (created once)."""
        if self._reader is None:
            from mindspeed_proxy.proxy.io.dist.chunks import ChunkReader

            self._reader = ChunkReader(self.folder)
        return self._reader

    def expert_row_groups(self, layer: MoELayer):
        """Lists of E tensors (one per expert) whose Grams sum to `layer`'s expert-weight Gram, one list per
        stored chunk region, memory-mapped one region at a time; a key whose chunks do not tile the
        experts as a grid is read as a layer slab instead."""
        from mindspeed_proxy.proxy.io.dist.chunks import layer_row_groups

        E = self.layout.num_experts
        for key in self.sliced[layer.global_layer]:
            if not stacked_name(key).startswith(EXPERTS):
                continue
            groups = layer_row_groups(self.chunk_reader(), key, None if self.per_layer else layer.global_layer, E)
            if groups is None:
                slab = self.layer_slabs(layer)[stacked_name(key)]
                groups = [[slab[e] for e in range(E)]]
            yield from groups

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


def kept_of(plan, layer_id: int) -> list:
    """Kept source expert ids of global layer `layer_id`."""
    for layer, kept in plan.kept.items():
        if layer.global_layer == layer_id:
            return kept
    raise ConversionError(f"layer {layer_id} has experts but no plan")


def proxy_objects(ckpt: DistCheckpoint, plan) -> dict:
    """{proxy object name: (key, shape, offset, source object name)} for every kept sharded object."""
    out = {}
    K = plan.target.num_experts
    for name, (key, shape, offset) in ckpt.index.objects.items():
        if not is_sliced(key):
            out[name] = (key, shape, offset, name)
            continue
        layer = key_layer(key)
        if len(shape) != (1 if layer is not None else 2):
            raise ConversionError(f"{ckpt.folder}: expert object {name} has shape {shape}, expected "
                                  f"{'(E,)' if layer is not None else '(L, E)'}")
        kept = kept_of(plan, offset[0] if layer is None else layer)
        if offset[-1] in kept:
            new = offset[:-1] + (kept.index(offset[-1]),)
            new_shape = shape[:-1] + (K,)
            out[f"{key}/shard_{'.'.join(map(str, new))}_{'.'.join(map(str, new_shape))}"] = (key, new_shape, new, name)
    return out


def write_dist(ckpt: DistCheckpoint, plan, new_args, out_root: str, progress=None, workers: int = 1,
               digests: Optional[dict] = None) -> str:
    """Write the proxy with megatron `dist_checkpointing.save` under `out_root`, one chunk in memory at a
    time per writer thread (`workers` threads; see dist_writer); return its iteration folder. `digests`:
    filled with the written records' digests (dist_writer.save_streaming)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from mindspeed_proxy.proxy.io.dist.writer import save_streaming

    ensure_group()
    index, model = ckpt.index, {}
    objects = proxy_objects(ckpt, plan)
    values = read_regions(ckpt.folder, index.object_requests(sorted({v[3] for v in objects.values()})))
    for name, (key, shape, offset, source) in objects.items():
        model[name] = ShardedObject(key, values[source], shape, offset, replica_id=0)
    common = index.common
    from mindspeed_proxy.proxy.plan import kept_fields

    state = {k: common[k] for k in kept_fields(KEPT_COMMON, plan.options) if k in common and k != "content_metadata"}
    state["args"] = new_args
    folder = os.path.join(out_root, iteration_dir_name(ckpt.iteration))
    os.makedirs(folder)
    save_streaming(ckpt, plan, state, model, folder, common.get("content_metadata"), progress, threads=workers,
                   digests=digests)
    with open(os.path.join(out_root, TRACKER), "w", encoding="utf-8") as fh:
        fh.write(str(ckpt.iteration))
    return folder
