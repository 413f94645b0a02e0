"""What Megatron-LM's `train_rl.py` training step needs on the CPU platform (rows of feature cpu-platform).

`train_rl.py`'s `forward_step` passes `get_default_packed_seq_params(...)` to the model when sequence packing is
off: PackedSeqParams in the "thd" format describing one sequence spanning the whole row (cu_seqlens [0, s, ..., s]),
kept "for CUDA graph signature consistency" (its docstring: "acts as no-op for a single sequence"). Only
Transformer Engine's attention takes packed params; megatron-core's local `DotProductAttention` (the only
attention without TE) asserts `packed_seq_params is None`, and the THD RoPE path breaks at micro-batch size > 1.
On the CPU platform (no CUDA graphs: `mindspeed_proxy.cpu_flags` refuses them) the row answers None, megatron's
own "not packed" value: the row is then one ordinary causal sequence, which is what the default params describe.
Real packing (`--rl-use-sequence-packing`) is refused by the launcher on CPU.

At TP>1 with sequence parallelism the linear layers all-gather into megatron-core's `GlobalMemoryBuffer`; the
engine's forward allocates that buffer under `torch.inference_mode()`, and the training passes after it reuse it.
gloo writes the gathered input in place, which torch forbids on an inference tensor outside inference mode (NCCL
writes device memory outside autograd's view). The second row drops such a cached buffer when asked for one
outside inference mode, so a fresh ordinary tensor is allocated (its contents are overwritten anyway).
"""
from __future__ import annotations

import functools

import torch

# Where train_rl.py imports the function from (it binds the name when the script runs, after the patches).
TARGET = "megatron.rl.sequence_packing_utils:get_default_packed_seq_params"


def _no_default_packing(original):
    """`get_default_packed_seq_params` answers None (no packing): the local attention takes no packed params."""

    @functools.wraps(original)
    def get_default_packed_seq_params(seq_length, max_sequences_per_bin, device):
        return None

    return get_default_packed_seq_params


def _no_inference_buffers(original):
    """`GlobalMemoryBuffer.get_tensor` outside inference mode never hands out a buffer made inside it."""

    @functools.wraps(original)
    def get_tensor(self, tensor_shape, dtype, name, *args, **kwargs):
        cached = self.buffer.get((name, dtype))
        if cached is not None and cached.is_inference() and not torch.is_inference_mode_enabled():
            del self.buffer[(name, dtype)]
        return original(self, tensor_shape, dtype, name, *args, **kwargs)

    return get_tensor


BUFFER_TARGET = "megatron.core.utils:GlobalMemoryBuffer.get_tensor"


def rows() -> list[tuple[str, object, bool, str]]:
    """(target, builder, optional, versions key) rows: Megatron-LM's RL only exists with a checkout (optional)."""
    return [(TARGET, _no_default_packing, True, "megatron-lm"),
            (BUFFER_TARGET, _no_inference_buffers, False, "megatron-core")]
