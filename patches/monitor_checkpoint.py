"""Patches that keep the mechanism monitor's state inside Megatron-LM's own checkpoints (`pretrain_gpt.py`).

- `generate_state_dict` (megatron.training.checkpointing; `save_checkpoint` calls it by module name): the
  dict it returns gains the key `mechanism_monitor` (monitor/state.py) when a monitor runs and the format
  is `torch` or `torch_dist`. Legacy: one more key of each written `model_optim_rng.pt`; torch_dist: a plain
  value, so dist_checkpointing keeps it in the common state (rank 0's copy; the state is rank-agnostic).
  `load_checkpoint` also calls it to build its request: a plain value there is dropped by the load, which
  returns the common state instead.
- `_load_base_checkpoint` (same module; both `load_checkpoint` calls and `load_args_from_checkpoint` go
  through it): the monitor restores the saved state from the dict it returns, unless `--finetune` (Megatron-LM
  then starts at iteration 0, so the monitor starts fresh too). A checkpoint without the key (saved without
  the monitor, or before this patch) leaves the monitor as built.

Written against Megatron-LM core_v0.16.1 (run end to end, tests/test_megatron_lm_monitor_state.py); the
two functions keep their names, call sites and return values in core_v0.17.1, 0.18.2 and 0.19.0 (read).
"""
from __future__ import annotations

import functools

from mindspeed_proxy.patches.registry import register_wrappers
from mindspeed_proxy.patches.runtime import RUNTIME

VERSIONS = ">=0.16.0,<0.20"  # Megatron-LM lines whose checkpointing.py was checked (see above)
FORMATS = ("torch", "torch_dist")  # torch_dcp / fsdp_dtensor build their load requests otherwise: untouched


def generate_state_dict_wrapper(original):
    """Wrap Megatron-LM's generate_state_dict: add the monitor's state (legacy key / torch_dist common state)."""

    @functools.wraps(original)
    def generate_state_dict(args, *rest, **kwargs):
        state_dict = original(args, *rest, **kwargs)
        if RUNTIME.monitor is not None and getattr(args, "ckpt_format", "torch") in FORMATS:
            from mindspeed_proxy.monitor.state import KEY, MonitorPart

            state_dict[KEY] = MonitorPart(RUNTIME.monitor).state_dict()
        return state_dict

    return generate_state_dict


def load_base_checkpoint_wrapper(original):
    """Wrap Megatron-LM's _load_base_checkpoint: the monitor restores the state the loaded dict holds."""

    @functools.wraps(original)
    def _load_base_checkpoint(load_dir, args, *rest, **kwargs):
        result = original(load_dir, args, *rest, **kwargs)
        state_dict = result[0] if isinstance(result, tuple) and result else None
        if RUNTIME.monitor is not None and isinstance(state_dict, dict) and not getattr(args, "finetune", False):
            from mindspeed_proxy.monitor.state import KEY, MonitorPart

            from mindspeed_proxy.monitor.run_log import RunFolderError

            try:
                MonitorPart(RUNTIME.monitor).load_state_dict(state_dict.get(KEY), where=f"--load {load_dir}")
            except RunFolderError as exc:  # the checkpoint is not of the run in the monitor's output folder
                RUNTIME.refuse(exc)
        return result

    return _load_base_checkpoint


def register_all() -> None:
    """Add these rows to the registry table (feature `mechanism-monitor`, Megatron-LM only: optional)."""
    from mindspeed_proxy.patches.monitor_patches import FEATURE

    register_wrappers([
        ("megatron.training.checkpointing:generate_state_dict", generate_state_dict_wrapper, True, VERSIONS),
        ("megatron.training.checkpointing:_load_base_checkpoint", load_base_checkpoint_wrapper, True, VERSIONS),
    ], FEATURE)
