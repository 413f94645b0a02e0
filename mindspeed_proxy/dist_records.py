"""Safe reading of the pickled records of a torch_dist checkpoint (ShardedObjects and the common state).

torch.distributed.checkpoint keeps every non-tensor item of a torch_dist checkpoint as a pickled record
(a BytesStorageMetadata entry of `.metadata`): megatron's ShardedObjects (`_extra_state` of every linear
layer, expert ones included, `rng_state`, optimizer param groups and bucket sizes, the rerun state, our
per-rank `checkpoint_parts.*`) and, from megatron-core 0.19, the common state `common_state/shard_0_1`.
Its load planner unpickles each with `weights_only=False` (`DefaultLoadPlanner.load_bytes`, inherited by
megatron-core's MCoreLoadPlanner in 0.16-0.19, and used bare by 0.19's `load_common_state_dict`), so
`dist_checkpointing.load` runs whatever such a record names.

The rule here: every record is read by this module, as raw bytes at the place `.metadata` gives, and
unpickled with `weights_only=True` and megatron-core's safe globals (checkpoint_io.safe_torch_load_bytes),
before megatron reads anything; a refused record is named by its key in one line (a ValueError), nothing of
it run. `load` then calls megatron's `dist_checkpointing.load` with the ShardedObjects taken out of the
request: each becomes a LocalNonpersistentObject holding its safely read value, which megatron's load hands
back in its place unread (megatron's own mechanism for values that are not in the checkpoint), so megatron
never unpickles a requested object.

Why not a safe load planner: megatron's TorchDistLoadShardedStrategy.load builds its MCoreLoadPlanner inside
(0.16 and 0.19 alike), so a planner with a safe `load_bytes` needs either a patch (the library never patches)
or a copy of that method; the 0.16-0.18 route of a sharded strategy that leaves objects to a common strategy
is gone in 0.19 (no common strategy). Reading every record first also covers what megatron may still unpickle
on its own (an object built by a ShardedTensorFactory, 0.19's common state, `common.pt` under torch < 2.6):
those bytes were accepted by the restricted unpickler, so the full one calls only allowed globals on them
(files rewritten between the two reads aside). Records are small (KiB each); every rank reads all of them.
"""
from __future__ import annotations

import os
from typing import Optional

from mindspeed_proxy.checkpoint_io import (
    CheckpointReadError,
    TruncatedCheckpointError,
    safe_torch_load,
    safe_torch_load_bytes,
)

COMMON_FILE = "common.pt"
COMMON_STATE = "common_state/shard_0_1"  # ShardedObject("common_state", None, (1,), (0,)).unique_key


def read_metadata(folder: str):
    """torch.distributed.checkpoint's Metadata of `folder` (its `.metadata`); one-line error if unreadable."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise CheckpointReadError(f"{folder}: missing .metadata (incomplete torch_dist checkpoint)")
    try:
        return FileSystemReader(folder).read_metadata()
    except Exception as exc:  # a cut or damaged .metadata raises many types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointReadError(f"truncated or unreadable shard: {folder}: {first}") from None


def record_keys(metadata) -> list:
    """The keys of every pickled record `metadata` lists (ShardedObject unique keys), sorted."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    return sorted(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))


def _places(metadata) -> dict:
    """{record key: its storage info (file, offset, length)}; tensor chunks (with offsets) left out."""
    return {k.fqn: v for k, v in metadata.storage_data.items() if k.offset is None}


def read_record(folder: str, metadata, key: str, trust: bool = False, places: Optional[dict] = None):
    """Record `key` of torch_dist `folder`: its bytes at the place `metadata` gives (`places`: _places of it),
    unpickled with `weights_only=True` and megatron-core's safe globals (full unpickling only with `trust`)."""
    info = (_places(metadata) if places is None else places).get(key)
    if info is None:
        raise CheckpointReadError(f"{folder}: .metadata lists the object {key} but not where it is stored")
    if getattr(info, "transform_descriptors", None):
        raise CheckpointReadError(f"{folder}: the object {key} is stored with transforms "
                                  f"{list(info.transform_descriptors)}, which this reader does not undo")
    path = os.path.join(folder, info.relative_path)
    try:
        with open(path, "rb") as fh:
            fh.seek(info.offset)
            data = fh.read(info.length)
    except OSError as exc:
        raise CheckpointReadError(f"{path}: cannot read the object {key} ({exc.strerror or exc})") from None
    if len(data) != info.length:
        raise TruncatedCheckpointError(f"truncated file {path}: the object {key} ends past its end")
    return safe_torch_load_bytes(data, f"{path} (object {key})", trust=trust)


def read_records(folder: str, metadata=None, trust: bool = False) -> dict:
    """{key: unpickled value} of every pickled record of torch_dist `folder` (read_record each)."""
    metadata = read_metadata(folder) if metadata is None else metadata
    places = _places(metadata)
    return {key: read_record(folder, metadata, key, trust, places) for key in record_keys(metadata)}


def read_common(folder: str, metadata=None, trust: bool = False, records: Optional[dict] = None) -> dict:
    """The common state dict of torch_dist `folder`: `common.pt` (megatron-core < 0.19) or the record
    `common_state/shard_0_1` (0.19; taken from `records` when given), both read safely."""
    path = os.path.join(folder, COMMON_FILE)
    if os.path.isfile(path):
        return safe_torch_load(path, trust=trust)
    if records is not None and COMMON_STATE in records:
        loaded = records[COMMON_STATE]
    else:
        metadata = read_metadata(folder) if metadata is None else metadata
        if COMMON_STATE not in record_keys(metadata):
            raise CheckpointReadError(f"{folder}: missing {COMMON_FILE} and no {COMMON_STATE} record in .metadata "
                                      "(incomplete torch_dist checkpoint)")
        loaded = read_record(folder, metadata, COMMON_STATE, trust)
    if not (isinstance(loaded, (list, tuple)) and len(loaded) == 1 and isinstance(loaded[0], dict)):
        raise CheckpointReadError(f"{folder}: the {COMMON_STATE} record holds {type(loaded).__name__}, not [dict]")
    return loaded[0]


def object_value(records: dict, key: str, where: str, index: int = 0):
    """The data of ShardedObject `key` in `records`: megatron saves each object as the list of the data of
    the ShardedObjects of that key on the saving rank (one), the request's `index`-th gets element `index`."""
    if key not in records:
        raise CheckpointReadError(f"{where}: no object {key} in the checkpoint")
    value = records[key]
    if not isinstance(value, list) or index >= len(value):
        raise CheckpointReadError(f"{where}: the object {key} holds {type(value).__name__}, not a list of "
                                  f"more than {index} values (not written by megatron's dist_checkpointing)")
    return value[index]


def load(sharded_state_dict: dict, folder: str, trust: bool = False, records: Optional[dict] = None) -> dict:
    """megatron-core's `dist_checkpointing.load(sharded_state_dict, folder)` with every pickled record read
    safely first (`records`: those read_records already gave, the common state read too) and each requested
    ShardedObject filled from them (the request is changed in place, as megatron's load changes it);
    ValueError with one line naming a refused record, raised before megatron reads anything."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject

    if records is None:
        metadata = read_metadata(folder)
        records = read_records(folder, metadata, trust)
        read_common(folder, metadata, trust, records)
    taken: dict = {}

    def fill(value):
        # a LocalNonpersistentObject is handed back by megatron's load in the request's place, unread
        if not isinstance(value, ShardedObject):
            return value
        key = value.unique_key
        taken[key] = taken.get(key, -1) + 1
        return LocalNonpersistentObject(object_value(records, key, folder, taken[key]))

    return dist_checkpointing.load(dict_list_map_inplace(fill, sharded_state_dict), folder)
