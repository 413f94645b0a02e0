"""The common (non-sharded) state of a torch_dist checkpoint, in either place megatron-core keeps it.

megatron-core < 0.19 writes it to `common.pt`; 0.19 writes it as the ShardedObject `common_state` inside the
`.distcp` files (and still reads a `common.pt`). The record is read as raw bytes at the offset `.metadata`
gives and unpickled with `weights_only=True` and megatron-core's safe globals: torch.distributed.checkpoint's
own load would unpickle it with `weights_only=False`.
"""
from __future__ import annotations

import os

from mindspeed_proxy.checkpoint_io import safe_torch_load, safe_torch_load_bytes
from mindspeed_proxy.proxy.core.errors import ConversionError

COMMON_FILE = "common.pt"
COMMON_STATE = "common_state/shard_0_1"  # ShardedObject("common_state", None, (1,), (0,)).unique_key


def is_common_record(key: str) -> bool:
    """True for the `.metadata` entry that holds the common state (megatron-core 0.19+)."""
    return key.split("/", 1)[0] == "common_state"


def read_common(folder: str, metadata, trust: bool = False) -> dict:
    """The common state dict of torch_dist `folder` (`metadata`: its torch.distributed.checkpoint Metadata)."""
    path = os.path.join(folder, COMMON_FILE)
    if os.path.isfile(path):
        return safe_torch_load(path, trust=trust)
    info = next((v for k, v in metadata.storage_data.items() if k.fqn == COMMON_STATE), None)
    if info is None:
        raise ConversionError(f"{folder}: missing {COMMON_FILE} and no {COMMON_STATE} record in .metadata "
                              "(incomplete torch_dist checkpoint)")
    if getattr(info, "transform_descriptors", None):
        raise ConversionError(f"{folder}: the {COMMON_STATE} record is stored with transforms "
                              f"{list(info.transform_descriptors)}, which this reader does not undo")
    shard = os.path.join(folder, info.relative_path)
    with open(shard, "rb") as fh:
        fh.seek(info.offset)
        data = fh.read(info.length)
    if len(data) != info.length:
        raise ConversionError(f"truncated file {shard}: the {COMMON_STATE} record ends past its end")
    loaded = safe_torch_load_bytes(data, f"{shard} ({COMMON_STATE})", trust=trust)
    if not (isinstance(loaded, (list, tuple)) and len(loaded) == 1 and isinstance(loaded[0], dict)):
        raise ConversionError(f"{shard}: the {COMMON_STATE} record holds {type(loaded).__name__}, not [dict]")
    return loaded[0]


KEPT_COMMON = ("args", "checkpoint_version", "iteration", "opt_param_scheduler",
               "num_floating_point_operations_so_far", "content_metadata")
