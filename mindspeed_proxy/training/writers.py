"""`--tensorboard-dir` of our trainer and RL loop: a SummaryWriter, handed to the monitor as Megatron-LM's own is.

Megatron-LM creates its writer in `initialize_megatron` (global_vars, on the last rank) and logs its scalars to
it; the mechanism monitor takes that writer under `pretrain_gpt.py` (patches/runtime.py). Our trainer and RL
loop build theirs here, on the rank that writes the monitor's sinks, log their per-step scalars to it, and put
it in the runtime before the optimizer (and with it the monitor) is built.
"""
from __future__ import annotations

STEP_SCALARS = ("loss", "grad_norm", "lr")  # trainer records -> tags "train/<key>"
RL_SCALARS = ("reward_mean", "exact_match", "entropy", "kl_ref", "topk_match_mean", "loss", "grad_norm", "lr")


def check_available(tensorboard_dir) -> None:
    """ValueError naming --tensorboard-dir when it is given and the tensorboard package is missing."""
    if not tensorboard_dir:
        return
    from mindspeed_proxy.extras import MissingExtra, require

    try:
        require("tensorboard", f"--tensorboard-dir {tensorboard_dir}")  # torch.utils.tensorboard needs it
    except MissingExtra as exc:
        raise ValueError(str(exc)) from None


def build_writer(tensorboard_dir, enabled: bool):
    """A torch SummaryWriter on `tensorboard_dir` when given and `enabled` (this rank writes), else None."""
    if not tensorboard_dir or not enabled:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=tensorboard_dir)


def log_scalars(writer, step: int, record: dict, keys, prefix: str) -> None:
    """Write the finite numbers of `record[keys]` as `prefix/<key>` at `step` (no-op without a writer)."""
    if writer is None:
        return
    for key in keys:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value \
                and abs(value) != float("inf"):
            writer.add_scalar(f"{prefix}/{key}", value, step)


def close(writer) -> None:
    """Flush and close a writer built here (None: nothing)."""
    if writer is not None:
        from mindspeed_proxy.patches.runtime import RUNTIME

        writer.flush()
        writer.close()
        if RUNTIME.tensorboard_writer is writer:
            RUNTIME.tensorboard_writer = None
