"""Read a Hugging Face MoE checkpoint (sharded safetensors + `model.safetensors.index.json`) and write its proxy.

Shards are opened with the `safetensors` library (`safe_open`, memory-mapped, never unpickled): a tensor
is paged in only when it is read, and its pages are dropped once used. The proxy's shards are written
one tensor at a time straight from those mappings (safetensors format: 8-byte header length, JSON
header, raw little-endian bytes) and then re-read through `safe_open` by the verifier.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch

from mindspeed_proxy.extras import require
from mindspeed_proxy.proxy.core.errors import ConversionError, read_json_object
from mindspeed_proxy.proxy.core.layout import Layout
from mindspeed_proxy.proxy.core.refs import LayerRef
from mindspeed_proxy.proxy.io import pages
from mindspeed_proxy.proxy.io.hf import layout as H
from mindspeed_proxy.proxy.io.protocol import rows_by_tensor_name

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SKIPPED = (CONFIG, INDEX, "proxy_manifest.json")


def looks_like_hf(folder: str) -> bool:
    """True if `folder` holds a config.json and safetensors weights (index or single file), and no Megatron tracker."""
    return (os.path.isfile(os.path.join(folder, CONFIG))
            and (os.path.isfile(os.path.join(folder, INDEX)) or os.path.isfile(os.path.join(folder, SINGLE)))
            and not os.path.isfile(os.path.join(folder, "latest_checkpointed_iteration.txt")))


def check_options(options, iteration) -> None:
    """Refuse the flags that only mean something for Megatron checkpoints."""
    if iteration is not None:
        raise ConversionError("--iteration applies to Megatron checkpoints only (a Hugging Face folder has none)")
    if options.keep_optimizer_args:
        raise ConversionError("--keep-optimizer-args applies to Megatron checkpoints only")
    if options.feature_type == "outputs":
        raise ConversionError("--features outputs is not supported for Hugging Face checkpoints yet; use "
                              "weights or a features FILE")
    if options.selection == "reconstruction" or options.representative == "saliency":
        raise ConversionError("--selection reconstruction and --representative saliency need the calibration "
                              "forward, not supported for Hugging Face checkpoints yet")


def _read_json(path: str, what: str) -> dict:
    return read_json_object(path, f"{path} ({what})")


class HFCheckpoint:
    """A Hugging Face MoE checkpoint folder, validated: config, index, every shard and every MoE layer's keys."""

    format = "hf"

    def __init__(self, root: str):
        self.root, self.iteration = root, None
        if not os.path.isfile(os.path.join(root, CONFIG)):
            raise ConversionError(f"--load {root}: no {CONFIG} (not a Hugging Face checkpoint)")
        require("safetensors", f"--load {root} (a Hugging Face checkpoint)")
        self.config = _read_json(os.path.join(root, CONFIG), CONFIG)
        where = os.path.join(root, CONFIG)
        num_experts = H.expert_count(self.config, where)
        self.arch = H.architecture(self.config, where)
        self.args = H.routing_args(self.config, num_experts, where)
        self.layout = Layout(tp=1, pp=1, ep=1, num_experts=num_experts, dp=1)
        self.sharded = os.path.isfile(os.path.join(root, INDEX))
        self._handles: dict = {}
        self.weight_map = self._weight_map()
        self._check_shards()
        self.keys = find_layers_checked(self)
        self.layers = [LayerRef(0, "model", k.prefix, k.global_layer) for k in self.keys]
        self._by_prefix = {k.prefix: k for k in self.keys}

    def _weight_map(self) -> dict:
        if not self.sharded:
            if not os.path.isfile(os.path.join(self.root, SINGLE)):
                raise ConversionError(f"--load {self.root}: no {INDEX} and no {SINGLE}")
            return {key: SINGLE for key in self._open(SINGLE).keys()}
        index = _read_json(os.path.join(self.root, INDEX), INDEX)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or \
                not all(isinstance(v, str) for v in weight_map.values()):
            raise ConversionError(f"{os.path.join(self.root, INDEX)}: no weight_map {{key: shard file}}")
        for shard in sorted(set(weight_map.values())):
            if os.path.basename(shard) != shard or not os.path.isfile(os.path.join(self.root, shard)):
                raise ConversionError(f"{self.root}: missing shard {shard} named in {INDEX}")
        return weight_map

    def _open(self, shard: str):
        if shard not in self._handles:
            from safetensors import safe_open

            path = os.path.join(self.root, shard)
            try:
                self._handles[shard] = safe_open(path, framework="pt")
            except Exception as exc:  # truncated header, bad JSON, not a safetensors file
                raise ConversionError(f"{path}: truncated or unreadable shard ({type(exc).__name__}: "
                                      f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})") from None
        return self._handles[shard]

    def _check_shards(self) -> None:
        by_shard: dict = {}
        for key, shard in self.weight_map.items():
            by_shard.setdefault(shard, set()).add(key)
        for shard, keys in sorted(by_shard.items()):
            held = set(self._open(shard).keys())
            if not keys <= held:
                raise ConversionError(f"{os.path.join(self.root, shard)}: {INDEX} names {sorted(keys - held)[0]!r} "
                                      "in this shard, which does not hold it")
            for key in keys:  # a short file is caught here (the header's offsets past its end)
                self.shape(key)

    def shape(self, key: str) -> tuple:
        """Shape of tensor `key` from its shard's header (nothing read)."""
        try:
            return tuple(self._open(self.weight_map[key]).get_slice(key).get_shape())
        except Exception as exc:
            raise ConversionError(f"{os.path.join(self.root, self.weight_map[key])}: truncated or unreadable "
                                  f"shard ({key}: {exc})") from None

    def dtype_name(self, key: str) -> str:
        """safetensors dtype string of `key` (e.g. 'BF16')."""
        return self._open(self.weight_map[key]).get_slice(key).get_dtype()

    def tensor(self, key: str) -> torch.Tensor:
        """Tensor `key`, memory-mapped from its shard (not copied)."""
        return self._open(self.weight_map[key]).get_tensor(key)

    def layer_keys(self, layer) -> "H.LayerKeys":
        """The LayerKeys of LayerRef `layer`."""
        return self._by_prefix[layer.prefix]

    def expert(self, layer, global_id: int, tp: int = 0) -> dict:
        """{name: tensor} of expert `global_id` (per-expert keys, or slices of the fused tensors)."""
        keys = self.layer_keys(layer)
        if keys.fused:
            return {name: self.tensor(key)[global_id] for name, key in keys.fused.items()}
        return {name: self.tensor(key) for name, key in keys.experts[global_id].items()}

    def router(self, layer) -> dict:
        """{'weight': [E, H], other `gate.*` tensors (e.g. 'e_score_correction_bias': [E])} of `layer`."""
        return {name: self.tensor(key) for name, key in self.layer_keys(layer).router.items()}

    def expert_row_groups(self, layer):
        """One list of E tensors per expert tensor name (protocol.rows_by_tensor_name)."""
        return rows_by_tensor_name(self, layer)

    def rewrite_config(self, target: Layout) -> tuple:
        """The proxy's config.json (expert-count fields = K) and {field: [old, new]}."""
        return H.rewrite_config(self.config, target.num_experts)

    def release(self) -> None:
        """Close every shard (their mappings go once no tensor refers to them)."""
        self._handles.clear()

    def close(self) -> None:
        """Same as release."""
        self.release()

    def copied_files(self) -> list:
        """Top-level files copied unchanged into the proxy (tokenizer, generation config, code, ...)."""
        shards = set(self.weight_map.values())
        return sorted(n for n in os.listdir(self.root) if os.path.isfile(os.path.join(self.root, n))
                      and n not in shards and n not in SKIPPED and not n.startswith("."))

    def file_paths(self) -> list:
        """Every file the proxy is made from (config, index, shards, copied files), sorted, for hashing."""
        names = {CONFIG, *self.weight_map.values(), *self.copied_files()} | ({INDEX} if self.sharded else set())
        return sorted(os.path.join(self.root, n) for n in names)

    def bytes_to_write(self, plan) -> int:
        """Tensor bytes of the proxy (from the shard headers)."""
        return sum(_numel(shape) * _ITEMSIZE[dtype] for _, shape, dtype in _output_specs(self, plan))

    def manifest_info(self) -> dict:
        """The Hugging Face facts the manifest records."""
        return {"model_type": self.config.get("model_type"),
                "expert_count_fields": sorted(f for f in H.COUNT_FIELDS if self.config.get(f) is not None),
                "expert_layout": sorted({k.layout for k in self.keys}), "sharded": self.sharded,
                "copied_files": self.copied_files()}


def find_layers_checked(ckpt: HFCheckpoint) -> list:
    """The MoE layers' keys, with router/fused shapes checked against E and the MoE layers the config implies."""
    where = ckpt.root
    E = ckpt.layout.num_experts
    layers = H.find_layers(sorted(ckpt.weight_map), ckpt.arch, E, where)
    if not layers:
        raise ConversionError(f"--load {where}: no MoE layer (no *.experts.* with a *.gate.weight router) in "
                              f"{INDEX if ckpt.sharded else SINGLE}")
    for entry in layers:
        for key in [*entry.router.values(), *entry.fused.values()]:
            shape = ckpt.shape(key)
            if not shape or shape[0] != E:
                raise ConversionError(f"{where}: {key} has shape {list(shape)}, expected {E} experts first "
                                      f"(config says {E})")
    expected = H.expected_moe_layers(ckpt.config)
    found = {k.global_layer for k in layers if k.global_layer < (ckpt.config.get("num_hidden_layers") or 0)}
    if expected is not None and found != expected:
        raise ConversionError(f"{where}: MoE layers {sorted(found)} in the weights, config.json implies "
                              f"{sorted(expected)}")
    return layers


_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def output_plan(ckpt: HFCheckpoint, plan) -> list:
    """[(proxy key, source key, kept rows of a router / fused expert tensor, or None: copied whole)]."""
    owner = {}
    for entry, layer in zip(ckpt.keys, ckpt.layers):
        kept = plan.kept[layer]
        for key in [*entry.router.values(), *entry.fused.values()]:
            owner[key] = (key, kept)
        for old, names in entry.experts.items():
            for name, key in names.items():
                owner[key] = (H.renamed_expert_key(entry, kept.index(old), name), None) if old in kept else None
    out = []
    for key in sorted(ckpt.weight_map, key=lambda k: (ckpt.weight_map[k], k)):
        if key not in owner:
            out.append((key, key, None))
        elif owner[key] is not None:
            out.append((owner[key][0], key, owner[key][1]))
    return out


def _output_specs(ckpt: HFCheckpoint, plan):
    for new, key, rows in output_plan(ckpt, plan):
        shape = ckpt.shape(key)
        yield new, (len(rows), *shape[1:]) if rows is not None else shape, ckpt.dtype_name(key)


def shard_names(ckpt: HFCheckpoint, plan) -> dict:
    """{source shard: proxy shard} for the source shards that still hold a tensor, renumbered 1..n."""
    used = []
    for _, key, _ in output_plan(ckpt, plan):
        if ckpt.weight_map[key] not in used:
            used.append(ckpt.weight_map[key])
    if not ckpt.sharded:
        return {SINGLE: SINGLE}
    return {s: f"model-{i + 1:05d}-of-{len(used):05d}.safetensors" for i, s in enumerate(used)}


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_safetensors(path: str, entries: list, metadata: Optional[dict] = None) -> int:
    """Write [(key, dtype, shape, tensor or callable)] as one safetensors file, tensor by tensor; return bytes."""
    header, offset = {}, 0
    for key, dtype, shape, _ in entries:
        size = _numel(shape) * _ITEMSIZE[dtype]
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)  # tensor data starts 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for key, dtype, shape, source in entries:
            tensor = source() if callable(source) else source
            if tuple(tensor.shape) != tuple(shape):
                raise ConversionError(f"writing {path}: {key} has shape {list(tensor.shape)}, header says {shape}")
            fh.write(_bytes(tensor))
            pages.drop(tensor)
    return offset


def write_hf(ckpt: HFCheckpoint, plan, out: str) -> list:
    """Write the proxy under `out`: config.json (expert counts = K), the shards, the index, copied files."""
    with open(os.path.join(out, CONFIG), "w", encoding="utf-8") as fh:
        json.dump(plan.new_args, fh, indent=2)
        fh.write("\n")
    for name in ckpt.copied_files():
        shutil.copyfile(os.path.join(ckpt.root, name), os.path.join(out, name))
    names = shard_names(ckpt, plan)
    groups: dict = {}
    for new, key, rows in output_plan(ckpt, plan):
        shape = ckpt.shape(key)
        shape = (len(rows), *shape[1:]) if rows is not None else shape
        source = (lambda key=key, rows=rows: ckpt.tensor(key).index_select(0, torch.tensor(rows))) \
            if rows is not None else (lambda key=key: ckpt.tensor(key))
        groups.setdefault(names[ckpt.weight_map[key]], []).append((new, ckpt.dtype_name(key), shape, source))
    total, weight_map, written = 0, {}, []
    for shard, entries in groups.items():
        path = os.path.join(out, shard)
        total += write_safetensors(path, entries)
        weight_map.update({new: shard for new, _, _, _ in entries})
        written.append(path)
        ckpt.release()
    if ckpt.sharded:
        with open(os.path.join(out, INDEX), "w", encoding="utf-8") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, fh,
                      indent=2)
            fh.write("\n")
    return written
