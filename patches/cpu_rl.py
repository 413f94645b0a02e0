"""What Megatron-LM's `train_rl.py` training step needs on the CPU platform (rows of feature cpu-platform).

`train_rl.py`'s `forward_step` passes `get_default_packed_seq_params(...)` to the model when sequence packing is
off: PackedSeqParams in the "thd" format describing one sequence spanning the whole row (cu_seqlens [0, s, ..., s]),
kept "for CUDA graph signature consistency" (its docstring: "acts as no-op for a single sequence"). Only
Transformer Engine's attention takes packed params; megatron-core's local `DotProductAttention` (the only
attention without TE) asserts `packed_seq_params is None`, and the THD RoPE path breaks at micro-batch size > 1.
On the CPU platform (no CUDA graphs: `mindspeed_proxy.cpu_flags` refuses them) the row answers None, megatron's
own "not packed" value: the row is then one ordinary causal sequence, which is what the default params describe.
Real packing (`--rl-use-sequence-packing`) is refused by the launcher on CPU.
"""
from __future__ import annotations

import functools

# Where train_rl.py imports the function from (it binds the name when the script runs, after the patches).
TARGET = "megatron.rl.sequence_packing_utils:get_default_packed_seq_params"


def _no_default_packing(original):
    """`get_default_packed_seq_params` answers None (no packing): the local attention takes no packed params."""

    @functools.wraps(original)
    def get_default_packed_seq_params(seq_length, max_sequences_per_bin, device):
        return None

    return get_default_packed_seq_params


def rows() -> list[tuple[str, object, bool]]:
    """(target, builder, optional) rows: Megatron-LM's RL is only present with a checkout, so optional."""
    return [(TARGET, _no_default_packing, True)]
