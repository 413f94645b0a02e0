"""The common (non-sharded) state of a torch_dist checkpoint, in either place megatron-core keeps it.

megatron-core < 0.19 writes it to `common.pt`; 0.19 writes it as the ShardedObject `common_state` inside the
`.distcp` files (and still reads a `common.pt`). Both are read safely by mindspeed_proxy.dist_records (the
record as raw bytes at the offset `.metadata` gives, unpickled with `weights_only=True` and megatron-core's
safe globals: torch.distributed.checkpoint's own load would unpickle it with `weights_only=False`).
"""
from __future__ import annotations

from typing import Optional

from mindspeed_proxy import dist_records
from mindspeed_proxy.dist_records import COMMON_FILE, COMMON_STATE  # noqa: F401  (the names this package uses)
from mindspeed_proxy.proxy.core.errors import ConversionError


def is_common_record(key: str) -> bool:
    """True for the `.metadata` entry that holds the common state (megatron-core 0.19+)."""
    return key.split("/", 1)[0] == "common_state"


def read_common(folder: str, metadata, trust: bool = False, records: Optional[dict] = None) -> dict:
    """The common state dict of torch_dist `folder` (`metadata`: its torch.distributed.checkpoint Metadata;
    `records`: its records already read safely); ConversionError with one line if it cannot be read safely."""
    try:
        return dist_records.read_common(folder, metadata, trust, records)
    except ValueError as exc:
        raise ConversionError(str(exc)) from None


KEPT_COMMON = ("args", "checkpoint_version", "iteration", "opt_param_scheduler",
               "num_floating_point_operations_so_far", "content_metadata")
