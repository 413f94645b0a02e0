"""A synchronous torch_dist save hands its write results over a queue of the saving process (feature
inprocess-save-results, one row; applied by the test launcher's ranks only, never by a command of ours).

megatron-core's torch_dist writer (`FileSystemWriterAsync`) puts each rank's write results into
`filesystem_async._results_queue`, which it makes on the first save as a `spawn` Manager's queue: a new
interpreter that imports torch to unpickle the results, ~2.3 CPU-s per rank process. In a synchronous save
(`dist_checkpointing.save`, what our trainer and tests call) the same process puts the results and takes them
back, so a process-local `queue.Queue` carries them unchanged. A save megatron runs asynchronously in another
process (`--async-save`) would have to pickle that queue and fails loudly; it is not applied there.
"""
from __future__ import annotations

import queue

from mindspeed_proxy.patches.registry import Applied, Patch, apply_feature, register, revert_feature

FEATURE = "inprocess-save-results"
TARGET = "megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue"


def process_local_queue(original=None):
    """The torch_dist writer's results queue is a `queue.Queue` of this process (megatron's own, if it made one)."""
    return original if original is not None else queue.Queue()


def register_all() -> None:
    """Register the feature's one row (the module global exists, None until the first save, in 0.12 - 0.19)."""
    register(Patch(TARGET, process_local_queue, FEATURE,
                   description=process_local_queue.__doc__.splitlines()[0]))


def apply() -> Applied:
    """Give this process's torch_dist saves a process-local results queue; return the Applied handle."""
    register_all()
    return apply_feature(FEATURE)


def revert() -> list[str]:
    """Give megatron-core its own (lazily made) results queue back."""
    return revert_feature(FEATURE)
