"""Megatron-LM flags that cannot run on the CPU platform, refused by the launcher before anything runs.

Each entry names a flag of Megatron-LM's parser (core_v0.16-0.19), the values that switch the feature on, and
why a CPU cannot do it. `refusal(argv)` reads argv the way argparse does (`--flag value`, `--flag=value`, the
last occurrence wins, `--no-flag` turns a boolean off) and returns the one-line reason for the first such flag.
"""
from __future__ import annotations

from dataclasses import dataclass

_GRAPHS = "CUDA graphs capture CUDA kernels; the CPU platform runs eager torch"
_UVM = "unified memory is a CUDA allocator (managed memory); the CPU platform has only host memory"
_OFFLOAD = "offloading moves accelerator memory to the host; on the CPU platform everything already lives there"


@dataclass(frozen=True)
class Refused:
    """A flag and when it is refused: `on` is None for a boolean flag, else the values that are refused."""

    flag: str
    why: str
    on: tuple[str, ...] | None = None


REFUSED = (
    Refused("--cuda-graph-impl", _GRAPHS, ("local", "transformer_engine")),
    Refused("--enable-cuda-graph", _GRAPHS),
    Refused("--external-cuda-graph", _GRAPHS),
    Refused("--rl-training-cuda-graphs", _GRAPHS),
    Refused("--inference-dynamic-batching-unified-memory-level", _UVM, ("1",)),
    Refused("--rl-inference-model-unified-memory-level", _UVM, ("1",)),
    Refused("--rl-offload-inference-model-weights-when-idle", _UVM),
    Refused("--rl-offload-kv-cache-during-training", _OFFLOAD + " (and torch_memory_saver needs CUDA)"),
    Refused("--rl-offload-optimizer-during-inference", _OFFLOAD),
    Refused("--optimizer-cpu-offload", _OFFLOAD),
    Refused("--cpu-offloading", _OFFLOAD),
    Refused("--fine-grained-activation-offloading", _OFFLOAD),
    Refused("--rl-use-sequence-packing", "packed sequences need Transformer Engine's attention; the local spec's "
            "DotProductAttention (the one without TE) refuses packed_seq_params"),
    Refused("--refit-method", "the nccl and nvshmem refits need CUDA; use --refit-method gloo (the default)",
            ("nccl", "nvshmem")),
)


def _last_setting(argv: list[str], rule: Refused) -> str | None:
    """What argv last sets `rule.flag` to: its value, "on"/"off" for a boolean, None when absent."""
    setting = None
    negated = "--no-" + rule.flag[2:]
    for i, arg in enumerate(argv):
        if rule.on is None:
            if arg == rule.flag:
                setting = "on"
            elif arg == negated:
                setting = "off"
        elif arg == rule.flag and i + 1 < len(argv):
            setting = argv[i + 1]
        elif arg.startswith(rule.flag + "="):
            setting = arg.split("=", 1)[1]
    return setting


def refusal(argv: list[str]) -> str | None:
    """One line naming the first flag of `argv` the CPU platform cannot run and why; None when all can run."""
    for rule in REFUSED:
        setting = _last_setting(argv, rule)
        if setting is None or setting == "off" or (rule.on is not None and setting not in rule.on):
            continue
        shown = rule.flag if rule.on is None else f"{rule.flag} {setting}"
        return f"{shown} cannot run on the CPU platform: {rule.why}"
    return None
