"""Patches that switch the mechanism monitor on inside megatron-core training.

- `get_megatron_optimizer` (megatron-core, and Megatron-LM's imported copy): creates the
  MechanismMonitor for the model chunks it receives and wraps the returned optimizer's `step` so that
  each successful step (not one the grad scaler rejected) calls `after_optimizer_step(iteration)`;
  with a `nan-activation` fault it registers that fault's hook on the chunks (fault_patches).
- `TopKRouter.routing`: hands the logits it receives (before top-k) and the routing map it returns to
  `on_router_logits`. With no active monitor it only returns the original's result.
- `MoELayer.forward`: hands the MoE layer's input hidden states (after the pre-MLP norm) to
  `on_moe_input` for the expert-feature collector, on training forwards only (train mode, grad enabled, so
  a recomputed forward counts once; RUNTIME.phase "train"); nothing happens when the collector is off.
- Megatron-LM's `load_checkpoint`: after a load the monitor retakes the weight snapshots it holds
  (`weights_loaded`), so no ΔW spans the load. The monitor is built with the optimizer, before
  Megatron-LM's `setup_model_and_optimizer` loads `--load`.
- Megatron-LM's `save_checkpoint` / `load_checkpoint` keep the monitor's state: patches/monitor_checkpoint.py.
- The monitor takes the TensorBoard / wandb writers of `RUNTIME.writers()`: ours (--tensorboard-dir of our
  trainer / RL loop), else Megatron-LM's own (`initialize_megatron` created them before the optimizer).
- Megatron-LM's `parse_args`: adds our flags to Megatron-LM's own parser (so `--help` lists them); with
  `--mechanism-routing-replay r3` it sets `moe_enable_routing_replay` (megatron-core builds RouterReplay).
- Megatron-LM's RL loop (train_rl.py): patches/rl_rows.py (the rl family and R3); `TopKRouter.routing` hands
  every routing decision to its capture too.
"""
from __future__ import annotations

import functools

from mindspeed_proxy.patches.registry import BEFORE_0_18, register_wrappers
from mindspeed_proxy.patches.rl_capture import CAPTURE
from mindspeed_proxy.patches.runtime import RUNTIME

FEATURE = "mechanism-monitor"


def attach_monitor(optimizer, monitor) -> None:
    """Make `optimizer.step` count steps and report each successful one to `monitor` (may be None)."""
    if getattr(optimizer, "_mindspeed_proxy_step", False):
        return
    original_step = optimizer.step

    @functools.wraps(original_step)
    def step(*args, **kwargs):
        result = original_step(*args, **kwargs)
        iteration = RUNTIME.step_done()
        success = result[0] if isinstance(result, tuple) else bool(result)
        if success and monitor is not None:
            monitor.after_optimizer_step(iteration)
        return result

    optimizer.step = step
    optimizer.count_skipped_step = RUNTIME.step_done  # a step the trainer does not apply still counts
    optimizer._mindspeed_proxy_step = True
    optimizer.mechanism_monitor = monitor


def get_megatron_optimizer_wrapper(original):
    """Wrap megatron-core's get_megatron_optimizer to count steps and attach the monitor."""

    @functools.wraps(original)
    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        optimizer = original(config, model_chunks, *args, **kwargs)
        if RUNTIME.config is not None:
            from mindspeed_proxy.monitor import MechanismMonitor

            from mindspeed_proxy.monitor.run_log import RunFolderError

            tensorboard_writer, wandb_writer = RUNTIME.writers()
            try:
                RUNTIME.monitor = MechanismMonitor(
                    RUNTIME.config, model_chunks, optimizer, tensorboard_writer=tensorboard_writer,
                    wandb_writer=wandb_writer, iteration=RUNTIME.iteration or 0, resume=RUNTIME.resuming(),
                    tensorboard_dir=RUNTIME.tensorboard_dir())
            except RunFolderError as exc:  # another run's monitor.jsonl in the output folder: before training
                RUNTIME.refuse(exc)
            if RUNTIME.faults:
                RUNTIME.monitor.log_record({"type": "faults", "faults": [
                    {"name": f.name, **f.params} for f in RUNTIME.faults]})
        if RUNTIME.config is not None or RUNTIME.faults:
            attach_monitor(optimizer, RUNTIME.monitor)
        if any(f.name == "nan-activation" for f in RUNTIME.faults):
            from mindspeed_proxy.patches.fault_patches import attach_activation_faults

            attach_activation_faults(model_chunks)
        return optimizer

    return get_megatron_optimizer


def router_routing_wrapper(original):
    """Wrap TopKRouter.routing to pass its input logits and output routing map to the monitor."""

    @functools.wraps(original)
    def routing(self, logits, *args, **kwargs):
        result = original(self, logits, *args, **kwargs)
        monitor = RUNTIME.monitor
        if monitor is not None and RUNTIME.phase == "train":
            monitor.on_router_logits(self.layer_number, logits, result[1])
        CAPTURE.on_routing(self, result[0], result[1])
        return result

    return routing


def moe_forward_wrapper(original):
    """Wrap MoELayer.forward to pass its input hidden states to the monitor's expert-feature collector."""
    import torch

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        monitor = RUNTIME.monitor
        if (monitor is not None and monitor.wants_moe_input and RUNTIME.phase == "train" and self.training
                and torch.is_grad_enabled()):
            monitor.on_moe_input(self, hidden_states, RUNTIME.current_step())
        return original(self, hidden_states, *args, **kwargs)

    return forward


def parse_args_wrapper(original):
    """Wrap Megatron-LM's parse_args so its parser also carries our flags."""

    @functools.wraps(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        from mindspeed_proxy.monitor.arguments import add_monitor_arguments

        def provider(parser):
            parser = extra_args_provider(parser) if extra_args_provider is not None else parser
            return add_monitor_arguments(parser)
        args = original(extra_args_provider=provider, ignore_unknown_args=ignore_unknown_args)
        from mindspeed_proxy.patches.rl_replay_args import apply_routing_replay
        from mindspeed_proxy.patches.rl_sampling_seed import apply_sampling_seed

        apply_routing_replay(args)
        apply_sampling_seed(args)
        return args

    return parse_args


def load_checkpoint_wrapper(original):
    """Wrap Megatron-LM's load_checkpoint: the monitor retakes its weight snapshots after a load."""

    @functools.wraps(original)
    def load_checkpoint(*args, **kwargs):
        result = original(*args, **kwargs)
        if RUNTIME.monitor is not None:
            from mindspeed_proxy.monitor.run_log import RunFolderError

            try:
                RUNTIME.monitor.weights_loaded()
            except RunFolderError as exc:  # the loaded checkpoint is not of the run in the output folder
                RUNTIME.refuse(exc)
        return result

    return load_checkpoint


def register_all() -> None:
    """Add this feature's rows to the registry table."""
    rows = [
        ("megatron.core.optimizer:get_megatron_optimizer", get_megatron_optimizer_wrapper, False),
        ("megatron.training.training:get_megatron_optimizer", get_megatron_optimizer_wrapper, True),
        ("megatron.core.transformer.moe.router:TopKRouter.routing", router_routing_wrapper, False),
        ("megatron.core.transformer.moe.moe_layer:MoELayer.forward", moe_forward_wrapper, False),
        ("megatron.training.checkpointing:load_checkpoint", load_checkpoint_wrapper, True),
        ("megatron.training.training:load_checkpoint", load_checkpoint_wrapper, True),
        ("megatron.training.arguments:parse_args", parse_args_wrapper, True),
        # initialize_megatron parses the args itself before core_v0.18; from 0.18 `parse_and_validate_args`
        # of megatron.training.arguments does (the row above) and initialize.py no longer imports parse_args
        ("megatron.training.initialize:parse_args", parse_args_wrapper, True, BEFORE_0_18),
    ]
    register_wrappers(rows, FEATURE)
    from mindspeed_proxy.patches import monitor_checkpoint

    monitor_checkpoint.register_all()  # the monitor's state inside Megatron-LM's own checkpoints
    from mindspeed_proxy.patches import rl_rows

    rl_rows.register_all()  # Megatron-LM's RL loop: the rl family and R3
    from mindspeed_proxy.patches import rl_sampling_seed

    rl_sampling_seed.register_all()  # opt-in: one sampling seed per data-parallel engine (0.16-0.18)
