"""What a torch_dist folder holds (its metadata, its pickled records read safely), and megatron load requests
for its tensors."""
from __future__ import annotations

import json
import os
import re
import warnings

import torch

from mindspeed_proxy import dist_records
from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.core.keys import is_model_key, is_stacked
from mindspeed_proxy.proxy.io.dist.common import is_common_record, read_common
from mindspeed_proxy.proxy.io.dist.group import ensure_group

_OBJECT = re.compile(r"^(.+)/shard_([\d.]+)_([\d.]+)$")


def _dots(text: str) -> tuple:
    return tuple(int(x) for x in text.split("."))


def read_regions(folder: str, requests: dict) -> dict:
    """{name: tensor} for ShardedTensor `requests`, read with megatron's TorchDist load strategy (which
    unpickles objects unsafely: a ShardedObject request is refused); ConversionError if the files cannot
    deliver them."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if not all(isinstance(v, ShardedTensor) for v in requests.values()):
        raise TypeError("read_regions reads tensors only; objects come from DistIndex.object_value")
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
    sharded objects; files checked against the metadata (missing or truncated .distcp refused), then every
    pickled record read safely (mindspeed_proxy.dist_records) before anything else reads the folder."""

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
            self.records = dist_records.read_records(folder, meta, trust)
        except ValueError as exc:
            raise ConversionError(str(exc)) from None
        self.common = read_common(folder, meta, trust, self.records)
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

    def object_value(self, name: str):
        """The data of stored object `name` (a ShardedObject unique key), from the records read safely."""
        try:
            return dist_records.object_value(self.records, name, self.folder)
        except ValueError as exc:
            raise ConversionError(str(exc)) from None
