"""How one MoE layer's routed experts sit in a Megatron state dict: SequentialMLP, TEGroupedMLP, GroupedMLP."""
from __future__ import annotations

import re

import torch

from mindspeed_proxy.proxy.core.errors import ConversionError

_SEQUENTIAL = re.compile(r"local_experts\.(\d+)\.(.+)$")
_TE_GROUPED = re.compile(r"(linear_fc[12])\.(weight|bias)(\d+)$")


class SequentialCodec:
    """SequentialMLP: `experts.local_experts.{i}.linear_fc1.weight` (one module per local expert)."""

    name = "SequentialMLP"

    def owned(self, sd: dict, prefix: str) -> list[str]:
        """Keys of `sd` that belong to routed experts under `prefix` (`...mlp.experts.`)."""
        return [k for k in sd if k.startswith(prefix) and _SEQUENTIAL.match(k[len(prefix):])]

    def count(self, sd: dict, prefix: str) -> int:
        """Number of local experts stored under `prefix`."""
        return len({_SEQUENTIAL.match(k[len(prefix):]).group(1) for k in self.owned(sd, prefix)})

    def get(self, sd: dict, prefix: str, local: int, n_local: int) -> dict:
        """{name: value} of local expert `local` (names relative to the expert module)."""
        head = f"{prefix}local_experts.{local}."
        return {k[len(head):]: v for k, v in sd.items() if k.startswith(head)}

    def build(self, prefix: str, experts: list[dict]) -> dict:
        """State-dict entries holding `experts` as local experts 0..n-1."""
        return {f"{prefix}local_experts.{j}.{name}": value
                for j, expert in enumerate(experts) for name, value in expert.items()}


class TEGroupedCodec:
    """TEGroupedMLP: `experts.linear_fc1.weight{i}` (one GroupedLinear, a parameter per local expert)."""

    name = "TEGroupedMLP"

    def owned(self, sd: dict, prefix: str) -> list[str]:
        """Keys of `sd` that belong to routed experts under `prefix`."""
        return [k for k in sd if k.startswith(prefix) and _TE_GROUPED.fullmatch(k[len(prefix):])]

    def count(self, sd: dict, prefix: str) -> int:
        """Number of local experts stored under `prefix`."""
        return len({_TE_GROUPED.fullmatch(k[len(prefix):]).group(3) for k in self.owned(sd, prefix)})

    def get(self, sd: dict, prefix: str, local: int, n_local: int) -> dict:
        """{`linear_fc1.weight`: tensor, ...} of local expert `local`."""
        out = {}
        for k in self.owned(sd, prefix):
            module, kind, index = _TE_GROUPED.fullmatch(k[len(prefix):]).groups()
            if int(index) == local:
                out[f"{module}.{kind}"] = sd[k]
        return out

    def build(self, prefix: str, experts: list[dict]) -> dict:
        """State-dict entries holding `experts` as GroupedLinear parameters 0..n-1."""
        return {f"{prefix}{name}{j}": value for j, expert in enumerate(experts) for name, value in expert.items()}


class GroupedCodec:
    """Legacy GroupedMLP: `experts.weight1` [H, n*X] with expert i = weight1.view(n, H, -1)[i] (a memory
    block, not a column slice) and `experts.weight2` with expert i = weight2.view(n, -1, H)[i]."""

    name = "GroupedMLP"

    def owned(self, sd: dict, prefix: str) -> list[str]:
        """Keys of `sd` that belong to routed experts under `prefix`."""
        return [prefix + w for w in ("weight1", "weight2") if prefix + w in sd]

    def count(self, sd: dict, prefix: str) -> int:
        """Unknown from the tensors alone; the caller checks shapes against args instead."""
        return -1

    def get(self, sd: dict, prefix: str, local: int, n_local: int) -> dict:
        """{'weight1': [H, X], 'weight2': [Y, H]} blocks of local expert `local`."""
        w1, w2 = sd[prefix + "weight1"], sd[prefix + "weight2"]
        hidden = w1.shape[0]
        if w1.shape[1] % n_local or w2.shape[0] % n_local or w2.shape[1] != hidden:
            raise ConversionError(f"{prefix}weight1 {tuple(w1.shape)} / weight2 {tuple(w2.shape)} do not hold "
                                  f"{n_local} experts of hidden size {hidden}")
        return {"weight1": w1.view(n_local, hidden, -1)[local], "weight2": w2.view(n_local, -1, hidden)[local]}

    def build(self, prefix: str, experts: list[dict]) -> dict:
        """weight1/weight2 holding `experts` as blocks 0..n-1, in Megatron's shapes."""
        w1 = torch.stack([e["weight1"] for e in experts])
        w2 = torch.stack([e["weight2"] for e in experts])
        hidden = w1.shape[1]
        return {prefix + "weight1": w1.reshape(hidden, -1), prefix + "weight2": w2.reshape(-1, hidden)}


CODECS = (SequentialCodec(), TEGroupedCodec(), GroupedCodec())


def detect(sd: dict, prefix: str, where: str):
    """The codec whose keys appear under `prefix` in `sd`; ConversionError for an unknown layout."""
    found = [c for c in CODECS if c.owned(sd, prefix)]
    if len(found) == 1:
        return found[0]
    sample = sorted(k[len(prefix):] for k in sd if k.startswith(prefix))[:4]
    raise ConversionError(f"{where}: unknown expert layout under {prefix!r} (keys {sample}); supported: "
                          "local_experts.{i}.* (SequentialMLP), linear_fc1.weight{i} (TEGroupedMLP), "
                          "weight1/weight2 (GroupedMLP)")
