"""megatron-core's fused functions run eager (feature eager-jit, one row: `torch.compile` is the identity).

megatron-core decorates its fused kernels (activations, the router's `_apply_expert_bias`, the dispatcher's
preprocessing, ...) with `jit_fuser = torch.compile` when their modules are imported. On a CPU each decoration
imports torch._dynamo and torch._inductor (~2.2 CPU-s a process) and each first call builds C++ kernels. MindSpeed's
`requirements-basic` feature makes `torch.compile` a no-op on NPU the same way. Applied before megatron-core is
imported, the functions stay the plain Python functions they were written as; applied later it changes nothing
already decorated. Applied by the CPU platform (cpu_transfer.install) and by the converter, which reads torch_dist
checkpoints through megatron-core's dist_checkpointing and runs its calibration forward on CPU.
"""
from __future__ import annotations

from mindspeed_proxy.patches.registry import TORCH_SUPPORTED, Applied, Patch, apply_feature, register, revert_feature

FEATURE = "eager-jit"


def eager_compile(_original=None):
    """`torch.compile(fn)` / `@torch.compile(...)` returns `fn` itself: megatron-core's fused functions run eager."""

    def compile(model=None, **_options):
        return model if model is not None else (lambda fn: fn)

    return compile


def register_all() -> None:
    """Register the feature's one row."""
    register(Patch("torch:compile", eager_compile, FEATURE, versions=TORCH_SUPPORTED,
                   description=eager_compile.__doc__.splitlines()[0]))


def apply() -> Applied:
    """Make `torch.compile` the identity (once); return the Applied handle (empty when it already was)."""
    register_all()
    return apply_feature(FEATURE)


def revert() -> list[str]:
    """Give `torch.compile` back."""
    return revert_feature(FEATURE)
