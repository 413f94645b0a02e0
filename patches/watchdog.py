"""Never silently off: one line at the first optimizer step when the monitor is enabled but none of its hooks ran.

Armed only when the monitor is enabled (so a run without it is untouched): a torch global optimizer-step
post-hook (`torch.optim.optimizer.register_optimizer_step_post_hook`, which fires for every torch optimizer,
including the one inside Megatron's) checks once, at the first step, whether the patched
`get_megatron_optimizer` created the monitor; if not, rank 0 prints why, and the hook removes itself.
"""
from __future__ import annotations

import sys

from mindspeed_proxy.patches.runtime import RUNTIME

_handle: list = []
OPTIMIZER_TARGET = "megatron.core.optimizer:get_megatron_optimizer"


def arm() -> None:
    """Install the first-step check once (call when the monitor is enabled)."""
    if _handle:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _handle.append(register_optimizer_step_post_hook(_first_step))


def disarm() -> None:
    """Remove the check (it removes itself after the first step)."""
    while _handle:
        _handle.pop().remove()


def _first_step(optimizer, args, kwargs) -> None:
    disarm()
    if RUNTIME.config is None or RUNTIME.monitor is not None:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    print(f"mindspeed-proxy: the mechanism monitor is enabled but no monitor hook ran by the first optimizer step, "
          f"so nothing is monitored: {reason()}", file=sys.stderr, flush=True)


def reason() -> str:
    """Why the patched get_megatron_optimizer has not created the monitor, from where our rows went."""
    from mindspeed_proxy.patches.mindspeed_manager import registered_state
    from mindspeed_proxy.patches.monitor_patches import get_megatron_optimizer_wrapper
    from mindspeed_proxy.patches.registry import applied

    manager = RUNTIME.mindspeed_manager
    if manager is not None:
        state = registered_state(manager, OPTIMIZER_TARGET, get_megatron_optimizer_wrapper)
        if state == "registered":
            return ("our patches are registered with MindSpeed's patch manager, which has not applied them "
                    "(no MindSpeedPatchesManager.apply_patches() since: import mindspeed.megatron_adaptor after "
                    "mindspeed_proxy.megatron_adaptor, or add MechanismMonitorFeature to MindSpeed's feature list, "
                    "docs/monitor.md)")
        if state in ("removed", "absent"):
            return ("our patches were registered with MindSpeed's patch manager and removed since "
                    "(MindSpeedPatchesManager.remove_patches(), which MindSpeed-LLM's adaptor and MindSpeed's "
                    "repatch() call); add MechanismMonitorFeature to the feature list instead (docs/monitor.md)")
    elif OPTIMIZER_TARGET not in applied():
        return "the patches were never applied (mindspeed_proxy.patches.apply() or the adaptor import did not run)"
    return ("the optimizer was not built by the patched megatron.core.optimizer.get_megatron_optimizer (a "
            "reference to it taken before the patch, e.g. `from megatron.core.optimizer import "
            "get_megatron_optimizer` ahead of the adaptor import, or another optimizer factory)")
