"""Rows on Megatron-LM's RL loop (`train_rl.py`, megatron/rl/rl_utils.py): the monitor's rl family and R3.

- `megatron_rl_inference_mode` (rl_utils): while rollouts are collected RUNTIME.phase is "rollout" (the
  router family counts training passes only) and a fresh rollout table records the engine's experts.
- `DynamicInferenceContext.current_input_and_position_ids` (megatron-core): the engine asks its context for
  each step's flattened tokens; the router tap maps those tokens to (request, position) through it.
- `prepare_data_for_update` (rl_utils): one update: the rollout table is merged over all ranks before, the
  rl family is fed at train_rl.py's iteration after (patches/rl_capture.py).
- `_compute_logprobs_batch` (core_v0.16) / `compute_logprobs_batch` (core_v0.17-0.19): the no-grad logprob
  passes run with RUNTIME.phase "recompute"; the first one of an update is pi_old, whose experts, rows and
  full-distribution entropy are recorded.
- `get_logprobs` (rl_utils; train_rl.py imports it by name, so the row is in place before the script runs):
  marks each forward for the capture and, with `--mechanism-routing-replay r3`, replays the rollout's experts
  through megatron-core's RouterReplay (REPLAY_FORWARD: indices replayed, probabilities recomputed).
- `selective_log_softmax` (rl_utils, called by get_logprobs): the logits of the pi_old pass give the entropy.
- `align_unpacked_inference_logprobs` (rl_utils): the inference logprobs aligned to pi_old and the mask.

Names checked with `git show TAG:megatron/rl/rl_utils.py` at core_v0.16.1, 0.17.1, 0.18.2 and 0.19.0 (all
present there except `_compute_logprobs_batch`, renamed `compute_logprobs_batch` in 0.17); run against the
core_v0.16.1 functions (tests/test_megatron_lm_rl_rows.py). Megatron-LM has no routing replay in RL.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

from mindspeed_proxy.patches.registry import register_wrappers
from mindspeed_proxy.patches.rl_capture import CAPTURE
from mindspeed_proxy.patches.runtime import RUNTIME

VERSIONS = ">=0.16.0,<0.20"
BEFORE_0_17 = ">=0.16.0,<0.17"
FROM_0_17 = ">=0.17.0,<0.20"
RL = "megatron.rl.rl_utils"


def _phase(name: str):
    from mindspeed_proxy.rl.train import phase

    return phase(name)


def inference_mode_wrapper(original):
    """Wrap Megatron-LM's megatron_rl_inference_mode: phase "rollout" and a fresh rollout table around all of it.

    The phase spans the original's entry and exit too: a rank other than 0 yields at once and its engine serves
    its share of the requests inside the exit's `inference_interface.suspend()`."""

    @functools.wraps(original)
    @contextlib.contextmanager
    def megatron_rl_inference_mode(*args, **kwargs):
        CAPTURE.rollout = type(CAPTURE.rollout)()
        with _phase("rollout"):
            try:
                with original(*args, **kwargs) as interface:
                    yield interface
            finally:
                CAPTURE.context = None

    return megatron_rl_inference_mode


def context_inputs_wrapper(original):
    """Wrap DynamicInferenceContext.current_input_and_position_ids: the router tap reads this step's context."""

    @functools.wraps(original)
    def current_input_and_position_ids(self, *args, **kwargs):
        if RUNTIME.phase == "rollout":
            CAPTURE.context, CAPTURE.context_layers = self, set()
        return original(self, *args, **kwargs)

    return current_input_and_position_ids


def prepare_wrapper(original):
    """Wrap Megatron-LM's prepare_data_for_update: merge the rollout table, then feed the rl family."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def prepare_data_for_update(*args, **kwargs):
        if not CAPTURE.active():
            return original(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        CAPTURE.begin_update(bool(bound.get("sequence_packing", False)))
        CAPTURE.on_rollouts(bound.get("rollouts"))
        try:
            result = original(*args, **kwargs)
        finally:
            CAPTURE.in_update = CAPTURE.old_pass = False
        from megatron.core import parallel_state

        from mindspeed_proxy.patches.runtime import megatron_lm_args

        model = bound.get("model")
        CAPTURE.finish(parallel_state.get_data_parallel_group(), model=model[0] if model else None,
                       micro_batch=getattr(megatron_lm_args(), "micro_batch_size", None))
        return result

    return prepare_data_for_update


def compute_logprobs_wrapper(original):
    """Wrap Megatron-LM's (_)compute_logprobs_batch: phase "recompute"; the update's first pass is pi_old."""

    @functools.wraps(original)
    def compute_logprobs_batch(*args, **kwargs):
        CAPTURE.old_pass = CAPTURE.in_update and CAPTURE.passes == 0
        CAPTURE.passes += CAPTURE.in_update
        try:
            with _phase("recompute"):
                return original(*args, **kwargs)
        finally:
            CAPTURE.old_pass = False

    return compute_logprobs_batch


def get_logprobs_wrapper(original):
    """Wrap Megatron-LM's get_logprobs: mark the forward for the capture; under R3 replay the rollout's experts."""

    @functools.wraps(original)
    def get_logprobs(model, tokens, position_ids, *args, **kwargs):
        if not CAPTURE.active():
            return original(model, tokens, position_ids, *args, **kwargs)
        indices = CAPTURE.replay_indices(tokens)
        if CAPTURE.old_pass:
            CAPTURE.rows.append(tokens.detach().cpu())
            CAPTURE.train_routing.begin(*tokens.shape)
        try:
            if indices is None:
                return original(model, tokens, position_ids, *args, **kwargs)
            from mindspeed_proxy.rl import replay

            replay.set_indices(indices)
            with replay.replaying():
                return original(model, tokens, position_ids, *args, **kwargs)
        finally:
            if CAPTURE.old_pass:
                CAPTURE.train_routing.end()

    return get_logprobs


def selective_log_softmax_wrapper(original):
    """Wrap Megatron-LM's selective_log_softmax: the pi_old pass's logits give the entropy per position."""

    @functools.wraps(original)
    def selective_log_softmax(logits, index):
        if CAPTURE.old_pass and CAPTURE.active() and RUNTIME.monitor is not None:
            CAPTURE.on_old_entropy(logits)
        return original(logits, index)

    return selective_log_softmax


def align_wrapper(original):
    """Wrap Megatron-LM's align_unpacked_inference_logprobs: hand its result and inputs to the capture."""

    @functools.wraps(original)
    def align_unpacked_inference_logprobs(inference_logprobs, old_logprobs_for_data, generation_masks, *args,
                                          **kwargs):
        result = original(inference_logprobs, old_logprobs_for_data, generation_masks, *args, **kwargs)
        if CAPTURE.in_update and CAPTURE.active():
            CAPTURE.on_aligned(result, old_logprobs_for_data, generation_masks)
        return result

    return align_unpacked_inference_logprobs


def register_all() -> None:
    """Add these rows to the registry table (feature `mechanism-monitor`; Megatron-LM's RL only: optional)."""
    from mindspeed_proxy.patches.monitor_patches import FEATURE

    register_wrappers([
        (f"{RL}:megatron_rl_inference_mode", inference_mode_wrapper, True, VERSIONS),
        ("megatron.core.inference.contexts.dynamic_context:DynamicInferenceContext.current_input_and_position_ids",
         context_inputs_wrapper, True, VERSIONS),
        (f"{RL}:prepare_data_for_update", prepare_wrapper, True, VERSIONS),
        (f"{RL}:_compute_logprobs_batch", compute_logprobs_wrapper, True, BEFORE_0_17),
        (f"{RL}:compute_logprobs_batch", compute_logprobs_wrapper, True, FROM_0_17),
        (f"{RL}:get_logprobs", get_logprobs_wrapper, True, VERSIONS),
        (f"{RL}:selective_log_softmax", selective_log_softmax_wrapper, True, VERSIONS),
        (f"{RL}:align_unpacked_inference_logprobs", align_wrapper, True, VERSIONS),
    ], FEATURE)
