"""Multi-latent attention (MLA) on megatron-core's local spec and without an accelerator.

- Core attention (feature `mla-local-attention`, every device): `MultiLatentAttention.__init__` builds its
  core attention with `k_channels` (q/k head dim) and `v_channels` (value head dim). megatron-core's local
  spec gives it the local `DotProductAttention`, which takes neither (core_v0.12.0 .. core_v0.19.0: the
  `LocalSpecProvider.core_attention()` / the 0.12 spec name `DotProductAttention`), so
  `--multi-latent-attention --transformer-impl local` dies while building the model. The row builds the
  layer with `mindspeed_proxy.mla_attention.MLADotProductAttention` (the one our trainer and the converter's
  calibration builder use) in that slot, and only there: a TE or user-supplied core attention is kept. It has
  no parameters, so checkpoints are unchanged.
- YaRN (a row of feature `cpu-platform`): `YarnRotaryEmbedding.__init__` (MLA's default rope, and
  `--position-embedding-type yarn`) opens `with torch.device(torch.cuda.current_device())` unless
  `use_cpu_initialization`, and MLA never passes that flag. The CPU platform answers `current_device()`
  with 0, which `torch.device` reads as the accelerator ("Cannot access accelerator device when none is
  available"). On CPU the current device is the CPU, so the row builds the embedding as
  `use_cpu_initialization=True` asks: the same float32 `inv_freq` tensors, on the CPU. The
  `with torch.device(...)` block is in core_v0.15.0 .. core_v0.19.0 (0.12-0.14 pass the device to each
  factory, which the platform's factory rows already remap).
"""
from __future__ import annotations

import functools
import inspect

from mindspeed_proxy.patches.registry import MEGATRON_CORE_SUPPORTED, register_wrappers

FEATURE = "mla-local-attention"
YARN_DEVICE_BLOCK = ">=0.15.0,<0.20"


def _with_local_mla_core_attention(original):
    """MLA's core attention: megatron-core's local DotProductAttention -> MLADotProductAttention (takes k/v_channels)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        from mindspeed_proxy.mla_attention import with_mla_core_attention

        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["submodules"] = with_mla_core_attention(bound.arguments["submodules"])
        return original(*bound.args, **bound.kwargs)

    return __init__


def _yarn_on_cpu(original):
    """YaRN's inv_freq built on the CPU (`use_cpu_initialization=True`): the CPU platform's current device."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["use_cpu_initialization"] = True
        return original(*bound.args, **bound.kwargs)

    return __init__


def register_all() -> None:
    """Register the rows of feature `mla-local-attention`."""
    register_wrappers([("megatron.core.transformer.multi_latent_attention:MultiLatentAttention.__init__",
                        _with_local_mla_core_attention, False, MEGATRON_CORE_SUPPORTED)], FEATURE)


def cpu_rows() -> list[tuple[str, object, bool, str]]:
    """(target, builder, optional, versions) rows the CPU platform adds for MLA."""
    return [("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding:YarnRotaryEmbedding.__init__",
             _yarn_on_cpu, False, YARN_DEVICE_BLOCK)]
