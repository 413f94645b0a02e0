"""What megatron-core's dynamic inference engine needs on the CPU platform (rows of feature cpu-platform).

Megatron-LM's RL builds the dynamic engine (`DynamicInferenceContext` + `DynamicInferenceEngine`) on the
training model to make rollouts. Without an accelerator it stops at three places, each answered here:

- Attention under dynamic batching calls flash-attn 2's `flash_attn_varlen_func` (prefill / mixed
  batches) and `flash_attn_with_kvcache` (decode-only batches) on the paged KV cache, names that
  `megatron.core.transformer.attention` imports from flash-attn and sets to None without it: without
  flash-attn they become `mindspeed_proxy.paged_attention`'s torch versions (flash-attn's own when it
  is importable). Its `is_fa_min_version("2.7.3")` check then answers for the implementation
  installed: the flash-attn interface our functions follow (paged_attention.FLASH_ATTN_API_VERSION).
- The text generation controller makes its sampling generator with
  `torch.Generator(device=torch.cuda.current_device())`; that module alone sees a torch whose
  `Generator` maps a CUDA device to the CPU (a CPU generator, seeded as before).
- The dynamic context appends K/V with a triton kernel when triton imports (Megatron-LM's training
  deps install it); a triton kernel needs a GPU, so the context's own torch indexing path is used.

Written for megatron-core 0.16-0.19 (each target read in the core_v0.16.1, 0.17.1, 0.18.2, 0.19.0 source);
run end to end on 0.16.1 (tests/test_dynamic_inference.py).
"""
from __future__ import annotations

import functools
import types

# The megatron-core lines whose dynamic-inference call sites these rows were written against.
DYNAMIC_INFERENCE_VERSIONS = ">=0.16.0,<0.20"

_ATTENTION = "megatron.core.transformer.attention"
_CONTROLLER = "megatron.core.inference.text_generation_controllers.text_generation_controller"
_CONTEXT = "megatron.core.inference.contexts.dynamic_context"


def _varlen(original):
    """`flash_attn_varlen_func` in megatron's attention: flash-attn's where it imported, else the torch one."""
    from mindspeed_proxy import paged_attention

    return original if original is not None else paged_attention.flash_attn_varlen_func


def _kvcache(original):
    """`flash_attn_with_kvcache` in megatron's attention: flash-attn's where it imported, else the torch one."""
    from mindspeed_proxy import paged_attention

    return original if original is not None else paged_attention.flash_attn_with_kvcache


def _fa_min_version(original):
    """`is_fa_min_version` as megatron's attention sees it: where the rows above installed the torch flash-attn
    functions there, the interface version they follow; else megatron's own check."""
    import importlib

    from packaging.version import Version

    from mindspeed_proxy import paged_attention

    attention = importlib.import_module(_ATTENTION)
    if attention.flash_attn_varlen_func is not paged_attention.flash_attn_varlen_func:
        return original  # flash-attn imported: its own version answers
    ours = Version(paged_attention.FLASH_ATTN_API_VERSION)

    @functools.wraps(original)
    def is_fa_min_version(version, check_equality=True):
        return ours >= Version(version) if check_equality else ours > Version(version)

    return is_fa_min_version


class _TorchWithHostGenerator(types.ModuleType):
    """torch as one megatron module sees it: every name is torch's, except that `Generator(device=<cuda>)`
    makes a CPU generator."""

    def __init__(self, torch_module):
        super().__init__(torch_module.__name__, torch_module.__doc__)
        self._torch = torch_module

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def Generator(self, device="cpu"):  # noqa: N802 - torch's name
        """A torch.Generator on the CPU for a CUDA device spec (int, 'cuda[:N]', torch.device)."""
        from mindspeed_proxy.patches.cpu_transfer import cpu_device

        return self._torch.Generator(device=cpu_device(device))


def _host_generator(original):
    """The text generation controller's `torch`: its `torch.Generator(device=torch.cuda.current_device())`
    (the sampling generator) is made on the CPU; nothing else changes."""
    return original if isinstance(original, _TorchWithHostGenerator) else _TorchWithHostGenerator(original)


def _no_triton_append(_original):
    """The dynamic context's triton K/V-append kernel (needs a GPU): None, megatron's own "no triton" value, so
    it appends with torch indexing."""
    return None


def rows() -> list[tuple[str, object, bool, str]]:
    """(target, builder, optional, megatron-core versions) rows, applied in this order."""
    return [
        (f"{_ATTENTION}:flash_attn_varlen_func", _varlen, False, DYNAMIC_INFERENCE_VERSIONS),
        (f"{_ATTENTION}:flash_attn_with_kvcache", _kvcache, False, DYNAMIC_INFERENCE_VERSIONS),
        (f"{_ATTENTION}:is_fa_min_version", _fa_min_version, False, DYNAMIC_INFERENCE_VERSIONS),
        (f"{_CONTROLLER}:torch", _host_generator, False, DYNAMIC_INFERENCE_VERSIONS),
        (f"{_CONTEXT}:triton_append_key_value_cache", _no_triton_append, False, DYNAMIC_INFERENCE_VERSIONS),
    ]
