"""The reader protocol every source format implements (legacy, torch_dist, Hugging Face): planning, selection,
calibration and verification call these methods and never ask which format they hold."""
from __future__ import annotations

from typing import Iterator, Protocol

import torch

from mindspeed_proxy.proxy.core.layout import Layout
from mindspeed_proxy.proxy.core.plan_types import Plan
from mindspeed_proxy.proxy.core.refs import LayerRef


class SourceCheckpoint(Protocol):
    """A source checkpoint opened for conversion (LegacyCheckpoint, DistCheckpoint, HFCheckpoint)."""

    format: str  # "torch" (legacy), "torch_dist" or "hf"
    layout: Layout
    layers: list  # LayerRef of every MoE layer

    def expert(self, layer: LayerRef, global_id: int, tp: int) -> dict:
        """{tensor name: tensor} of one expert (TP piece `tp`)."""

    def router(self, layer: LayerRef) -> dict:
        """{'weight': [E, H], and the other per-expert router tensors} of `layer`."""

    def expert_row_groups(self, layer: LayerRef) -> Iterator[list]:
        """Lists of E same-shaped tensors (one per global expert) whose Grams sum to the layer's weight Gram."""

    def rewrite_config(self, target: Layout) -> tuple:
        """The proxy's args / config for `target` and the {field: [old, new]} diff."""

    def bytes_to_write(self, plan: Plan) -> int:
        """Tensor bytes the proxy of `plan` will hold."""

    def file_paths(self) -> list:
        """Every file the proxy is made from, sorted (hashed into the manifest)."""

    def release(self) -> None:
        """Drop cached tensors and mappings (called after each layer)."""

    def close(self) -> None:
        """Release everything this reader holds (files, process group)."""


def rows_by_tensor_name(ckpt: SourceCheckpoint, layer: LayerRef) -> Iterator[list]:
    """`expert_row_groups` of a reader whose experts are whole tensors: one list per expert tensor name and TP
    rank (TP rank 0 only with --moe-tp-extend-ep, whose TP ranks hold different experts)."""
    L = ckpt.layout
    for tp in ([0] if L.tp_extend_ep else range(L.tp)):
        names = sorted(n for n, v in ckpt.expert(layer, 0, tp).items() if isinstance(v, torch.Tensor))
        for name in names:
            yield [ckpt.expert(layer, g, tp)[name] for g in range(L.num_experts)]
