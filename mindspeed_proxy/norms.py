"""Sequence-parallel-capable RMSNorm / LayerNorm for megatron-core's local (non-TE) layer spec.

Megatron's `WrappedTorchNorm` refuses `sequence_parallel=True`, yet MoE with TP>1 requires it. These
norms compute exactly what `torch.nn.RMSNorm` / `torch.nn.LayerNorm` compute and tag their
parameters with `sequence_parallel`, so Megatron's `finalize_model_grads` all-reduces their
gradients over the tensor-parallel group as it does for TE's norms.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


class SequenceParallelNorm(torch.nn.Module):
    """RMSNorm or LayerNorm (per `config.normalization`) whose params are marked for SP grad sync."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str | None = None):
        super().__init__()
        self.normalization = normalization or config.normalization
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"SequenceParallelNorm supports RMSNorm and LayerNorm, not {self.normalization}")
        self.zero_centered_gamma = zero_centered_gamma or config.layernorm_zero_centered_gamma
        self.eps = eps
        self.hidden_size = hidden_size
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=dtype))
        self.bias = (
            torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
            if self.normalization == "LayerNorm" else None
        )
        for param in self.parameters():
            setattr(param, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of `x`."""
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.normalization == "RMSNorm":
            return F.rms_norm(x, (self.hidden_size,), weight, self.eps)
        return F.layer_norm(x, (self.hidden_size,), weight, self.bias, self.eps)


def _is_torch_norm_impl(module) -> bool:
    name = getattr(module, "__name__", "")
    return name in ("WrappedTorchNorm", "FusedLayerNorm") or (
        isinstance(module, type) and issubclass(module, (torch.nn.RMSNorm, torch.nn.LayerNorm))
    )


def with_sequence_parallel_norms(spec):
    """Return `spec` (a megatron ModuleSpec / submodules tree) with torch/apex norms replaced."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, (list, tuple)):
        return type(spec)(with_sequence_parallel_norms(s) for s in spec)
    if isinstance(spec, ModuleSpec):
        module = SequenceParallelNorm if _is_torch_norm_impl(spec.module) else spec.module
        return dataclasses.replace(spec, module=module,
                                   submodules=with_sequence_parallel_norms(spec.submodules))
    if isinstance(spec, type) and _is_torch_norm_impl(spec):
        return SequenceParallelNorm
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: with_sequence_parallel_norms(getattr(spec, f.name))
                   for f in dataclasses.fields(spec) if f.init}
        return dataclasses.replace(spec, **changes)
    return spec
