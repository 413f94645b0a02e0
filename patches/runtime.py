"""Process-wide state the patched Megatron functions read: the monitor config, the active monitor, the step."""
from __future__ import annotations

import contextlib
import os
from typing import Optional


class MonitorRuntime:
    """What `apply()` configured and what the patched get_megatron_optimizer created."""

    def __init__(self):
        self.config = None  # MonitorConfig when the monitor is enabled, else None
        self.monitor = None  # the MechanismMonitor of this process, once an optimizer exists
        self.iteration: Optional[int] = None  # steps taken so far (None: ask Megatron-LM's args)
        self.faults: list = []  # FaultSpec of every active fault injector
        self.phase = "train"  # "rollout" / "recompute" in an RL loop: only "train" passes feed the router family
        self.tensorboard_writer = None
        self.wandb_writer = None
        self.resume: Optional[bool] = None  # a checkpoint of this run will be loaded (None: ask Megatron-LM's args)
        self.mindspeed_manager = None  # MindSpeed's patch manager when our rows went through it
        self.routing_replay = "off"  # --mechanism-routing-replay: "r3" replays the rollout's experts (rl_rows.py)
        self.rl_gap_interval, self.rl_gap_samples = 0, 8  # --mechanism-monitor-rl-gap-*: train_rl.py's gap
        self.offset_sampling_seed = False  # --mechanism-offset-sampling-seed-by-dp-rank (rl_sampling_seed.py)

    def current_step(self) -> int:
        """1-based number of the optimizer step in progress (or just finished, inside its step()).

        When Megatron-LM drives training and no start was set, its own counter: `train()` publishes
        the 0-based step as `args.curr_iteration` before each `train_step` (`args.iteration` is only
        the start iteration; core_v0.12-0.19 training.py). Otherwise our counter of finished steps + 1.
        """
        if self.iteration is None:
            current = getattr(megatron_lm_args(), "curr_iteration", None)
            if isinstance(current, int):
                return current + 1
        return (self.iteration or 0) + 1

    def step_done(self) -> int:
        """Record that an optimizer step finished; return its 1-based number."""
        number = self.current_step()
        if self.iteration is not None or megatron_lm_args() is None:
            self.iteration = number
        return number

    def writers(self) -> tuple:
        """(TensorBoard, wandb) writers for the monitor: those set here, else Megatron-LM's own (global_vars:
        `initialize_megatron` created them, on the last rank, before any optimizer exists), else None."""
        tensorboard, wandb = self.tensorboard_writer, self.wandb_writer
        if megatron_lm_args() is not None:
            from megatron.training import global_vars

            tensorboard = tensorboard if tensorboard is not None else global_vars.get_tensorboard_writer()
            wandb = wandb if wandb is not None else global_vars.get_wandb_writer()
        return tensorboard, wandb

    def resuming(self) -> bool:
        """Whether a checkpoint load follows the optimizer (and the monitor): ours say so in `resume`; under
        Megatron-LM, `--load` of a folder with a checkpoint tracker and no `--finetune`."""
        if self.resume is not None:
            return self.resume
        args = megatron_lm_args()
        load = getattr(args, "load", None)
        return bool(load) and not getattr(args, "finetune", False) and \
            os.path.isfile(os.path.join(load, "latest_checkpointed_iteration.txt"))

    def tensorboard_dir(self) -> Optional[str]:
        """Megatron-LM's --tensorboard-dir (its writer lives on the last rank only), else None."""
        return getattr(megatron_lm_args(), "tensorboard_dir", None) or None

    def refuse(self, exc: Exception):
        """Stop this launch before training: one line on rank 0 (every rank reached the same verdict), exit 2."""
        import sys

        import torch

        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"mindspeed-proxy: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2)

    def reset(self) -> None:
        """Forget the monitor (tests, or a second model in the same process)."""
        if self.monitor is not None:
            self.monitor.close()
        self.__init__()


@contextlib.contextmanager
def phase(name: str):
    """Tell the patched router hooks and faults which pass runs (rollout / recompute / train)."""
    previous, RUNTIME.phase = RUNTIME.phase, name
    try:
        yield
    finally:
        RUNTIME.phase = previous


def megatron_lm_args():
    """Megatron-LM's parsed args when megatron.training is importable and initialised, else None."""
    try:
        from megatron.training import global_vars
    except ImportError:
        return None
    return getattr(global_vars, "_GLOBAL_ARGS", None)


RUNTIME = MonitorRuntime()
