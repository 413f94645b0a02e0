"""The key grammar of torch_dist checkpoints: model keys, stacked layer keys, keys with an expert axis."""
from __future__ import annotations

import re
from typing import Optional, Union

STACKED = "decoder.layers."
EXPERTS = "decoder.layers.mlp.experts."
ROUTER = "decoder.layers.mlp.router."
_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_PER_LAYER_MOE = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.(experts|router)\.")
# multi-token prediction layers: never stacked, one key per MTP layer, experts global [E, ...]
MTP_MLP = re.compile(r"^mtp\.layers\.(\d+)\.transformer_layer\.mlp\.")
_MTP_MOE = re.compile(r"^mtp\.layers\.(\d+)\.transformer_layer\.mlp\.(experts|router)\.")


def is_model_key(key: str) -> bool:
    """True for model entries (not optimizer state, RNG or rerun-state-machine records: megatron-core 0.19
    saves the latter always, per source rank, and Megatron-LM's --finetune load does not ask for it; nor the
    per-rank checkpoint parts of our RL loop, e.g. its reference policy: training/checkpoint_parts.py)."""
    return not key.startswith(("optimizer.", "rng_state", "rerun_state_machine_state", "checkpoint_parts."))


def is_stacked(key: str) -> bool:
    """True for `decoder.layers.*` keys stored with a leading layer axis (megatron's homogeneous layers)."""
    return key.startswith(STACKED) and not _PER_LAYER.match(key)


def key_layer(key: str) -> Union[int, str, None]:
    """Layer id (LayerRef.id) of a per-layer key: `decoder.layers.{l}.*` (non-homogeneous layers) -> l,
    `mtp.layers.{i}.transformer_layer.*` -> "mtp.i"; None for stacked and other keys."""
    match = _PER_LAYER.match(key)
    if match:
        return int(match.group(1))
    match = MTP_MLP.match(key)
    return f"mtp.{match.group(1)}" if match else None


def is_mtp_moe(key: str) -> bool:
    """True for the routed experts and router of a multi-token prediction layer."""
    return bool(_MTP_MOE.match(key))


def is_sliced(key: str) -> bool:
    """True for tensors/objects with an expert axis: routed experts and router rows, stacked, per layer or of
    a multi-token prediction layer."""
    return key.startswith((EXPERTS, ROUTER)) or bool(_PER_LAYER_MOE.match(key)) or is_mtp_moe(key)


def expert_axis(key: str) -> int:
    """The expert axis of a sliced key: 1 after the layer axis of a stacked key, else 0."""
    return 1 if is_stacked(key) else 0


def stacked_name(key: str) -> str:
    """`decoder.layers.{l}.mlp.X` and `mtp.layers.{i}.transformer_layer.mlp.X` -> `decoder.layers.mlp.X` (the
    name of the same tensor when stacked)."""
    if MTP_MLP.match(key):
        return MTP_MLP.sub(STACKED + "mlp.", key, count=1)
    return _PER_LAYER.sub(STACKED, key, count=1)
