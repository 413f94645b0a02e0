"""Forward hooks that hand megatron-core router logits to a monitor (until the TopKRouter patch exists).

A hook on each `TopKRouter` recomputes the gating logits from the router's input under no_grad (the
same `gating` call the router made; input jitter, off by default, is not reproduced) and passes them
with the router's routing map to `monitor.on_router_logits(layer_number, logits, routing_map)`.
"""
from __future__ import annotations

import torch


def attach_router_hooks(model_chunks, monitor) -> list:
    """Register the hooks on every TopKRouter in `model_chunks`; return the handles (call .remove())."""
    from megatron.core.transformer.moe.router import TopKRouter

    def hook(router, inputs, output):
        with torch.no_grad():
            logits = router.gating(inputs[0])
        routing_map = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        monitor.on_router_logits(router.layer_number, logits, routing_map)

    handles = []
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                handles.append(module.register_forward_hook(hook))
    return handles
