"""Process-wide state the patched Megatron functions read: the monitor config, the active monitor, the step."""
from __future__ import annotations

from typing import Optional


class MonitorRuntime:
    """What `apply()` configured and what the patched get_megatron_optimizer created."""

    def __init__(self):
        self.config = None  # MonitorConfig when the monitor is enabled, else None
        self.monitor = None  # the MechanismMonitor of this process, once an optimizer exists
        self.iteration: Optional[int] = None  # steps taken so far (None: ask Megatron-LM's args)
        self.faults: list = []  # FaultSpec of every active fault injector
        self.tensorboard_writer = None
        self.wandb_writer = None

    def next_iteration(self) -> int:
        """Megatron's 1-based number of the step that just ran (Megatron-LM's args.iteration + 1 when
        Megatron-LM drives training and no start was set, else our own counter)."""
        if self.iteration is None:
            args = megatron_lm_args()
            if args is not None:
                return (getattr(args, "iteration", 0) or 0) + 1
        self.iteration = (self.iteration or 0) + 1
        return self.iteration

    def reset(self) -> None:
        """Forget the monitor (tests, or a second model in the same process)."""
        if self.monitor is not None:
            self.monitor.close()
        self.__init__()


def megatron_lm_args():
    """Megatron-LM's parsed args when megatron.training is importable and initialised, else None."""
    try:
        from megatron.training import global_vars
    except ImportError:
        return None
    return getattr(global_vars, "_GLOBAL_ARGS", None)


RUNTIME = MonitorRuntime()
