"""A Megatron checkpoint directory: the latest-iteration tracker file and the iteration folders."""
from __future__ import annotations

import os
from typing import Optional

from mindspeed_proxy.proxy.core.errors import ConversionError

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir_name(iteration) -> str:
    """`iter_{:07d}`, or `release` for Megatron's release checkpoints."""
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def resolve_iteration(root: str, iteration: Optional[int]):
    """The iteration to convert (from --iteration or the tracker) and its folder; ConversionError if absent."""
    if not os.path.isdir(root):
        raise ConversionError(f"--load {root}: no such directory")
    if iteration is None:
        tracker = os.path.join(root, TRACKER)
        if not os.path.isfile(tracker):
            raise ConversionError(f"--load {root}: no {TRACKER} (not a Megatron checkpoint directory)")
        text = open(tracker, encoding="utf-8").read().strip()
        if text != "release" and not text.isdigit():
            raise ConversionError(f"{tracker}: expected an iteration number or 'release', found {text!r}")
        iteration = text if text == "release" else int(text)
    folder = os.path.join(root, iteration_dir_name(iteration))
    if not os.path.isdir(folder):
        raise ConversionError(f"--load {root}: iteration {iteration} has no folder {folder}")
    return iteration, folder
