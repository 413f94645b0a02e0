"""Feed a hand-built monitor the router logits through the registry's own `TopKRouter.routing` patch."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def routed_to(monitor):
    """Within the block every `TopKRouter.routing` call hands its logits and routing map to `monitor`, through
    the mechanism-monitor rows of the patch registry (applied without a config: no monitor of their own is
    built); on leaving, the runtime's monitor is restored and the rows this call applied are reverted."""
    from mindspeed_proxy.patches import monitor_patches
    from mindspeed_proxy.patches.registry import apply_feature
    from mindspeed_proxy.patches.runtime import RUNTIME

    monitor_patches.register_all()
    applied = apply_feature(monitor_patches.FEATURE)
    previous, RUNTIME.monitor = RUNTIME.monitor, monitor
    try:
        yield monitor
    finally:
        RUNTIME.monitor = previous
        applied.revert()
