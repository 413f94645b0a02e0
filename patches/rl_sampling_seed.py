"""`--mechanism-offset-sampling-seed-by-dp-rank`: each data-parallel engine samples with its own seed (opt-in).

Megatron-LM core_v0.16-0.18 seeds every dynamic engine's sampler with `inference_sampling_seed`, which
`megatron/training/arguments.py` sets to `--seed` on every rank, so in train_rl.py two data-parallel engines
draw the same tokens for the same prompt and a GRPO group holds repeated samples (docs/megatron_lm.md). The row
reseeds each TextGenerationController with `inference_sampling_seed + data-parallel rank`, as core_v0.19 does
by default (`InferenceConfig.offset_sampling_seed_by_dp_rank`); tensor-parallel ranks of one engine keep one
seed. Off by default: without the flag the controller is Megatron-LM's, untouched.
"""
from __future__ import annotations

import functools

from mindspeed_proxy.patches.registry import register_wrappers
from mindspeed_proxy.patches.runtime import RUNTIME

CONTROLLER = "megatron.core.inference.text_generation_controllers.text_generation_controller"
VERSIONS = ">=0.16.0,<0.19"  # core_v0.19.0 offsets the seed by the data-parallel rank itself


def apply_sampling_seed(args) -> None:
    """Read the flag from Megatron-LM's (or our launcher's) parsed `args` into the runtime."""
    RUNTIME.offset_sampling_seed = bool(getattr(args, "mechanism_offset_sampling_seed_by_dp_rank", False))


def controller_init_wrapper(original):
    """Wrap TextGenerationController.__init__: with the flag, reseed its sampler by the data-parallel rank."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if RUNTIME.offset_sampling_seed:
            from megatron.core import parallel_state
            from megatron.core.utils import get_model_config

            seed = get_model_config(self.inference_wrapped_model.model).inference_sampling_seed
            rank = parallel_state.get_data_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
            self.sampling_rng.manual_seed(seed + rank)

    return __init__


def register_all() -> None:
    """Add the row to the registry table (feature `mechanism-monitor`; optional: inference may be absent)."""
    from mindspeed_proxy.patches.monitor_patches import FEATURE

    register_wrappers([(f"{CONTROLLER}:TextGenerationController.__init__", controller_init_wrapper, True,
                        VERSIONS)], FEATURE)
