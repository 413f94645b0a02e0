"""The loss and grad norm of a run from its TensorBoard event files (Megatron-LM's tags or our trainer's)."""
from __future__ import annotations

import os
from typing import Optional

LOSS_TAGS = ("lm loss", "train/loss")  # Megatron-LM's training_log, our trainer (training/writers.py)
GRAD_NORM_TAGS = ("grad-norm", "train/grad_norm")


def has_event_files(folder: Optional[str]) -> bool:
    """Whether `folder` holds TensorBoard event files (at its top level)."""
    return bool(folder) and os.path.isdir(folder) and any(n.startswith("events.out.tfevents") for n in os.listdir(folder))


def read_loss(folder: str) -> tuple[Optional[str], dict[int, float], dict[int, float]]:
    """(loss tag found or None, {step: loss}, {step: grad norm}) of the event files in `folder`; the last value
    written at a step wins (a resumed run writes its steps again). Needs the tensorboard package."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder, size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags().get("scalars", []))
    loss_tag = next((t for t in LOSS_TAGS if t in tags), None)
    grad_tag = next((t for t in GRAD_NORM_TAGS if t in tags), None)
    loss = {e.step: e.value for e in acc.Scalars(loss_tag)} if loss_tag else {}
    grad = {e.step: e.value for e in acc.Scalars(grad_tag)} if grad_tag else {}
    return loss_tag, loss, grad
