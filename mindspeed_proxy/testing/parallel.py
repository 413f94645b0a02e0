"""Initialise megatron-core's parallel_state with explicit TP/PP/EP/CP sizes (process group must exist)."""
from __future__ import annotations

from typing import Optional


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, vpp: Optional[int] = None,
                  seed: int = 1234) -> None:
    """Initialise megatron's model-parallel groups and its RNG tracker for this rank."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def destroy_parallel() -> None:
    """Destroy megatron's model-parallel groups (the process group stays)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
