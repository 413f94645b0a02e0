"""The world-1 gloo process group megatron's dist_checkpointing needs in a single process."""
from __future__ import annotations

from mindspeed_proxy.proxy.core.errors import ConversionError

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
