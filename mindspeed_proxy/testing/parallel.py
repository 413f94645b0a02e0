"""Tests' parallel_state set-up: replace whatever layout is initialised (test-only), then `mindspeed_proxy.parallel`."""
from __future__ import annotations

from typing import Optional


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, vpp: Optional[int] = None,
                  seed: int = 1234) -> None:
    """Initialise megatron's model-parallel groups and its RNG tracker for this rank, destroying any existing
    ones first (a test starts from a clean layout; the library's `parallel.setup` refuses instead)."""
    from megatron.core import parallel_state as ps

    from mindspeed_proxy.parallel import setup

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    setup(tp=tp, pp=pp, ep=ep, cp=cp, vpp=vpp, seed=seed)


def destroy_parallel() -> None:
    """Destroy megatron's model-parallel groups (the process group stays)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
