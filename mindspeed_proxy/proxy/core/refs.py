"""`LayerRef`: the address of one MoE layer in a source checkpoint (not megatron's LayerRef module)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass(frozen=True)
class LayerRef:
    """One MoE layer of one pipeline stage and model chunk: a decoder layer, or the transformer layer of
    multi-token prediction layer `mtp` (`mtp.layers.{mtp}.transformer_layer.mlp.`, global_layer None)."""

    pp: int
    chunk: str
    prefix: str  # `decoder.layers.{i}.mlp.` or `mtp.layers.{i}.transformer_layer.mlp.`
    global_layer: Optional[int]
    mtp: Optional[int] = None

    @property
    def id(self) -> Union[int, str, None]:
        """The layer's id in plans, manifests and FILE inputs: the global decoder layer, or `mtp.N`."""
        return f"mtp.{self.mtp}" if self.mtp is not None else self.global_layer

    @property
    def name(self) -> str:
        """Readable id: `layer N` (global decoder layer), `mtp.N`, else stage/chunk/prefix."""
        if self.mtp is not None:
            return f"mtp.{self.mtp}"
        if self.global_layer is not None:
            return f"layer {self.global_layer}"
        return f"pp{self.pp}/{self.chunk}/{self.prefix}"


def id_order(layer_id) -> tuple:
    """Sort key of layer ids: decoder layers by number, then MTP layers by number."""
    if isinstance(layer_id, str) and layer_id.startswith("mtp."):
        return (1, int(layer_id[4:]))
    return (0, int(layer_id))
