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


@contextlib.contextmanager
def replaying_layers(layers: list[int], indices: torch.Tensor) -> Iterator[None]:
    """Replay `indices` [L, N, k] in the MoE layers `layers` only (the others route on their own)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    instances = RouterReplay.global_router_replay_instances
    try:
        for layer in layers:
            instances[layer].set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            instances[layer].set_target_indices(indices[layer])
        yield
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()


class RoutingProbabilities:
    """Forward hooks on a model's TopKRouters: record the probabilities of the chosen top-k, or replace them.

    A TopKRouter returns (probs [N, E], routing_map [N, E]); the chosen experts are those megatron-core's
    RouterReplay recorded or replays, so the recorded [N, k] follow the order of the recorded indices.
    With `replay` set to one [N, k] tensor per layer, the router's probabilities become those (the
    experts stay the replayed ones). `close()` removes the hooks.
    """

    def __init__(self, model):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.recorded: list = [None] * len(self.routers)
        self.replay: Optional[list] = None
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, layer: int):
        def hook(router, inputs, output):
            probs, routing_map = output
            chosen = _chosen_indices(router)
            if self.replay is not None:
                values = self.replay[layer].to(device=probs.device, dtype=probs.dtype)
                return torch.zeros_like(probs).scatter(1, chosen, values), routing_map
            self.recorded[layer] = probs.detach().gather(1, chosen).float()
            return None
        return hook

    def take(self) -> torch.Tensor:
        """The probabilities the last forward pass recorded: [L, N, k] float32."""
        if any(p is None for p in self.recorded):
            raise RuntimeError("no routing probabilities recorded: run a forward pass with routing recorded")
        out = torch.stack(self.recorded)
        self.recorded = [None] * len(self.routers)
        return out

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self.handles:
            handle.remove()


def _chosen_indices(router) -> torch.Tensor:
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    rr = router.router_replay
    if rr is None or rr.router_replay_action is None:
        raise RuntimeError("routing probabilities need routing replay on (moe_enable_routing_replay) and a "
                           "recording or replaying pass")
    idx = rr.target_topk_idx if rr.router_replay_action == RouterReplayAction.REPLAY_FORWARD else rr.recorded_topk_idx
    return idx.long()
