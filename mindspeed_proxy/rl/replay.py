"""Routing record and replay through megatron-core's own `RouterReplay` (0.16: `moe_enable_routing_replay`).

megatron-core's REPLAY_FORWARD gathers the router's *scores* (logits, or the sigmoid/pre-softmax
scores) at the replayed indices and recomputes the probabilities from them, so the expert choice is
replayed while the router still gets gradients. Indices are per forward pass, in the router's token
order (sequence-major: token s·B + b of a [S, B] batch), one [tokens, k] tensor per MoE layer.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

MODES = ("off", "r2", "r3")  # r2: replay the training pass's own first pass; r3: replay the rollout's routing


def router_replay_class():
    """megatron-core's RouterReplay, or None when the installed megatron-core has none."""
    try:
        from megatron.core.transformer.moe.router_replay import RouterReplay
    except ImportError:
        return None
    return RouterReplay


def reset_instances() -> None:
    """Forget the RouterReplay instances of earlier models (each TopKRouter registers one globally)."""
    cls = router_replay_class()
    if cls is not None:
        cls.clear_global_router_replay_instances()


def num_layers() -> int:
    """MoE layers whose router takes part in replay (this rank's model)."""
    cls = router_replay_class()
    return 0 if cls is None else len(cls.global_router_replay_instances)


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Record the routing of the forward passes inside; yields a list that gets one [L, N, k] tensor per pass."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    passes: list = []
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield passes
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()


def take_recorded() -> torch.Tensor:
    """The routing recorded by the last forward pass: [L, N, k] int64 (call inside `recording`)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    data = RouterReplay.get_recorded_data()
    if not data or any(d is None for d in data):
        raise RuntimeError("no routing recorded: the model has no MoE layer with routing replay enabled")
    return torch.stack([d.detach().to(torch.int64) for d in data])


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """Replay the indices set with `set_indices` in the forward passes inside."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()


def set_indices(indices: Optional[torch.Tensor]) -> None:
    """Routing for the next forward pass: [L, N, k] (None: leave the routers alone)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    if indices is None:
        return
    RouterReplay.clear_global_indices()  # drops the backward list megatron appends to on every set
    RouterReplay.set_replay_data(list(indices.unbind(0)))
