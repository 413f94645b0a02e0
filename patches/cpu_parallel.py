"""What tensor / context / sequence parallelism need on the CPU platform (rows of feature cpu-platform).

- Device queries: `torch.cuda.get_device_capability()` raises on a CPU-only torch and Megatron-LM's
  `validate_args` asks it for `--moe-grouped-gemm`; at TP>1 or CP>1 it asks Megatron-LM's own
  `get_device_arch_version()` (`torch.cuda.get_device_properties("cuda:0").major`). Both answer
  compute capability 8.0, what the eager fallbacks stand in for: below the 8.9 that FP8 paths and
  the 10.x that Blackwell-only paths key on, so neither is enabled. `get_device_properties` itself
  stays torch's: torch's inductor, wherever `torch.compile` runs for real (the CPU platform makes it eager,
  cpu_transfer.py), reads its raise as "no CUDA", and an answer there sends inductor down its CUDA/ROCm paths.
- `CUDA_DEVICE_MAX_CONNECTIONS`: below arch 10 Megatron-LM's `validate_args` requires it to be "1"
  at TP>1 / CP>1 (one hardware queue, so a TP collective is issued before the GEMM it overlaps).
  A CPU has exactly one queue: set "1" when unset, except for FSDP, which requires it unset.
- Sequence parallelism with the local spec: megatron-core's `WrappedTorchNorm` asserts
  `not config.sequence_parallel`. Under SP each TP rank normalises its own slice of the sequence (a
  per-token op: the forward is unchanged) and its weight gradient is a partial sum over that slice,
  which `finalize_model_grads` sums over the TP group for every parameter marked
  `sequence_parallel`, as Apex's FusedLayerNorm marks its own. The row builds the same torch norm and
  marks its parameters; without SP the original runs untouched.
"""
from __future__ import annotations

import copy
import functools
import os

# The one compute capability the CPU platform reports everywhere (capability, arch version).
CPU_CAPABILITY = (8, 0)


def _capability(_original):
    """`torch.cuda.get_device_capability()` answers CPU_CAPABILITY (8, 0)."""
    return lambda device=None: CPU_CAPABILITY


def _arch_version(_original):
    """Megatron-LM's `get_device_arch_version()` answers CPU_CAPABILITY's major (8: before Blackwell)."""

    def get_device_arch_version():
        return CPU_CAPABILITY[0]

    return get_device_arch_version


def _one_hardware_queue(original):
    """At TP>1 / CP>1 (not FSDP) set CUDA_DEVICE_MAX_CONNECTIONS=1 when unset: a CPU has one queue."""

    @functools.wraps(original)
    def validate_args(args, *rest, **kwargs):
        parallel = (getattr(args, "tensor_model_parallel_size", 1) or 1) > 1 or \
            (getattr(args, "context_parallel_size", 1) or 1) > 1
        fsdp = getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False)
        if parallel and not fsdp and "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        return original(args, *rest, **kwargs)

    return validate_args


def _sequence_parallel_norm(original):
    """The local spec's torch norm under sequence parallelism: same norm, parameters marked for the TP sum."""

    def __new__(cls, config, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original(cls, config, *args, **kwargs)
        local = copy.copy(config)
        local.sequence_parallel = False
        norm = original(cls, local, *args, **kwargs)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", True)
        return norm

    return staticmethod(__new__)


def rows() -> list[tuple[str, object, bool, str]]:
    """(target, builder, optional, versions key) rows: "torch" rows are not tied to megatron-core."""
    return [
        ("torch:cuda.get_device_capability", _capability, False, "torch"),
        ("megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__", _sequence_parallel_norm, True,
         "megatron-core"),
        # get_device_arch_version: where it is defined (0.12-0.17: utils.py; 0.18+: utils/common_utils.py),
        # the package's re-export, and arguments.py's imported name (what validate_args calls).
        ("megatron.training.utils:get_device_arch_version", _arch_version, True, "megatron-lm"),
        ("megatron.training.utils.common_utils:get_device_arch_version", _arch_version, True, "megatron-lm"),
        ("megatron.training.arguments:get_device_arch_version", _arch_version, True, "megatron-lm"),
        # validate_args: the defining module, and initialize.py's imported name (0.12-0.17).
        ("megatron.training.arguments:validate_args", _one_hardware_queue, True, "megatron-lm"),
        ("megatron.training.initialize:validate_args", _one_hardware_queue, True, "megatron-lm"),
    ]

