"""`LayerRef`: the address of one MoE layer in a source checkpoint (not megatron's LayerRef module)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LayerRef:
    """One MoE layer of one pipeline stage and model chunk."""

    pp: int
    chunk: str
    prefix: str  # `decoder.layers.{i}.mlp.`
    global_layer: Optional[int]

    @property
    def name(self) -> str:
        """Readable id: global layer number when known, else stage/chunk/prefix."""
        if self.global_layer is not None:
            return f"layer {self.global_layer}"
        return f"pp{self.pp}/{self.chunk}/{self.prefix}"
