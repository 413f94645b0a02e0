"""What a conversion may change in its process, captured before and put back after: RNG streams (Python, numpy,
torch, accelerator), megatron's RNG tracker and the environment. `convert()` runs inside `preserved()`."""
from __future__ import annotations

import contextlib
import os
import random
import sys

import numpy as np
import torch

_TRACKER_MODULE = "megatron.core.tensor_parallel.random"


def _tracker_snapshot():
    module = sys.modules.get(_TRACKER_MODULE)
    if module is None:
        return None
    tracker = module._CUDA_RNG_STATE_TRACKER
    fields = None
    if tracker is not None and hasattr(tracker, "states_"):
        fields = ({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tracker.states_.items()},
                  set(tracker.seeds_))
    return tracker, module._CUDA_RNG_STATE_TRACKER_INITIALIZED, fields


def capture() -> dict:
    """The process state a conversion may touch."""
    accelerator = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() \
        else None
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "accelerator": accelerator, "tracker": _tracker_snapshot(), "environ": dict(os.environ)}


def restore(snapshot: dict) -> None:
    """Put back what `capture` recorded (a tracker module imported since then returns to its import-time state)."""
    random.setstate(snapshot["python"])
    np.random.set_state(snapshot["numpy"])
    torch.set_rng_state(snapshot["torch"])
    if snapshot["accelerator"] is not None:
        torch.cuda.set_rng_state_all(snapshot["accelerator"])
    module = sys.modules.get(_TRACKER_MODULE)
    if module is not None:
        tracker, initialized, fields = snapshot["tracker"] or (None, False, None)
        module._CUDA_RNG_STATE_TRACKER, module._CUDA_RNG_STATE_TRACKER_INITIALIZED = tracker, initialized
        if fields is not None:
            tracker.states_, tracker.seeds_ = dict(fields[0]), set(fields[1])
    if dict(os.environ) != snapshot["environ"]:
        for name in set(os.environ) - set(snapshot["environ"]):
            del os.environ[name]
        os.environ.update(snapshot["environ"])


@contextlib.contextmanager
def preserved():
    """Run the block, then restore the RNG streams, megatron's RNG tracker and the environment."""
    snapshot = capture()
    try:
        yield
    finally:
        restore(snapshot)
