"""Frozen copies of a model's parameters and a context that runs a pass on them (reference policy, policy lag)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def snapshot(model) -> list[torch.Tensor]:
    """A detached copy of every parameter of `model`, in `parameters()` order."""
    return [p.detach().clone() for p in model.parameters()]


@contextlib.contextmanager
def swapped(model, weights: list[torch.Tensor]) -> Iterator[None]:
    """Run the block with `weights` in `model`'s parameters; the current values come back bit for bit."""
    params = list(model.parameters())
    if len(params) != len(weights):
        raise ValueError(f"{len(weights)} saved tensors for {len(params)} parameters")
    current = snapshot(model)
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, w in zip(params, current):
                p.copy_(w)
