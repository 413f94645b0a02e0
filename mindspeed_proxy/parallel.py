"""megatron-core's parallel_state for one TP/PP/EP/CP/VPP layout: set up, or reuse the caller's, never replace it.

`setup` initialises the model-parallel groups when none exist, reuses them when they already have the
requested layout, and refuses (ParallelSetupError, one line naming both layouts) when another layout is
initialised: the caller's process groups are never destroyed here. The returned `ParallelSetup` records
whether this call created them; its `teardown` destroys them only then. The process group itself
(torch.distributed) must exist before and is never touched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class ParallelSetupError(ValueError):
    """megatron's parallel_state is already initialised with a different layout."""


@dataclass(frozen=True)
class Layout:
    """Model-parallel sizes (expert TP defaults to TP, as in `initialize_model_parallel`)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    vpp: Optional[int] = None
    etp: Optional[int] = None

    def resolved(self) -> "Layout":
        """This layout with the expert TP size filled in."""
        return Layout(self.tp, self.pp, self.ep, self.cp, self.vpp, self.tp if self.etp is None else self.etp)

    def __str__(self) -> str:
        text = f"TP={self.tp} PP={self.pp} EP={self.ep} CP={self.cp} ETP={self.etp}"
        return text + (f" VPP={self.vpp}" if self.vpp else "")


def current_layout() -> Optional[Layout]:
    """The layout megatron's parallel_state is initialised with, or None."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return Layout(tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
                  ep=ps.get_expert_model_parallel_world_size(), cp=ps.get_context_parallel_world_size(),
                  vpp=ps.get_virtual_pipeline_model_parallel_world_size() or None,
                  etp=ps.get_expert_tensor_parallel_world_size())


@dataclass
class ParallelSetup:
    """What `setup` did: the layout in force and whether this setup created the groups (`owned`)."""

    layout: Layout
    owned: bool

    def teardown(self) -> None:
        """Destroy the model-parallel groups if this setup created them; otherwise leave them (idempotent)."""
        from megatron.core import parallel_state as ps

        if self.owned and ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        self.owned = False


def seed_all(seed: int) -> None:
    """Seed torch's default generator and megatron's model-parallel RNG tracker (per-rank TP/EP streams)."""
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def setup(tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, vpp: Optional[int] = None,
          etp: Optional[int] = None, seed: Optional[int] = None) -> ParallelSetup:
    """Initialise (or reuse, when identical) megatron's parallel_state for this layout; with `seed`, seed the
    RNGs. Raises ParallelSetupError when a different layout is initialised."""
    from megatron.core import parallel_state as ps

    wanted = Layout(tp, pp, ep, cp, vpp, etp).resolved()
    have = current_layout()
    if have is not None and have != wanted:
        raise ParallelSetupError(f"megatron's parallel_state is already initialised with {have}; this run needs "
                                 f"{wanted} (destroy the existing model-parallel groups first, or ask for their layout)")
    owned = have is None
    if owned:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    result = ParallelSetup(wanted, owned)
    if seed is not None:
        try:
            seed_all(seed)
        except BaseException:
            result.teardown()
            raise
    return result
