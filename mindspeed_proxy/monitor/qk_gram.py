"""Gram blocks of the QK-increment factors: one set per head serves Δ1, Δ2, Δ3 and the next monitor sample.

For one factor with old and new column blocks W and W' = W + Δ ([..., d, h]) the blocks are
D = ΔᵀΔ, C = WᵀΔ and G = WᵀW, each [..., h, h]. Every term's 2h×2h factor Gram is assembled from
them (query A = [ΔWq, Wq]; key B = [Wk, ΔWk] for Δ2, [Wk', ΔWk] for Δ1; ΔW alone for Δ3), and so is
the Gram of the new block, G' = G + C + Cᵀ + D. A caller whose next sample has exactly these new
blocks as its old ones (the monitor retakes its snapshot right after the sample) passes G' back as
`old_gram` and skips WᵀW: the d-long products of a factor drop from 4dh² flops (two symmetric
rank-k products and one GEMM) to 3dh². On CPU the symmetric products are BLAS syrk calls (numpy's
`a @ a.T` on one buffer), half the flops of the GEMM torch would run for them.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch

GRAM_CHUNK_ELEMENTS = 1 << 21  # d·h elements of one chunk's differences (four 4096×128 heads): cache-sized


class FactorBlocks(NamedTuple):
    """D = ΔᵀΔ, C = WᵀΔ, G = WᵀW of one factor, each [..., h, h] in the small-problem dtype."""

    delta: torch.Tensor
    cross: torch.Tensor
    old: torch.Tensor

    def new_gram(self) -> torch.Tensor:
        """Gram of the new block W' = W + Δ: G + C + Cᵀ + D."""
        return self.old + self.cross + self.cross.mT + self.delta


def _numpy_blas(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)


def rows_gram(rows: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """rows·rowsᵀ of [..., h, d] rows (into a contiguous `out` when given); on CPU one BLAS syrk per matrix."""
    if not _numpy_blas(rows):
        gram = rows @ rows.mT
        return gram if out is None else out.copy_(gram)
    rows = rows.detach().contiguous()
    if out is None:
        out = rows.new_empty(rows.shape[:-1] + rows.shape[-2:-1])
    for a, o in zip(rows.reshape((-1,) + rows.shape[-2:]).numpy(), out.view((-1,) + out.shape[-2:]).numpy()):
        np.matmul(a, a.T, out=o)  # numpy detects the transposed view of one buffer: ?syrk, then mirrors it
    return out


def factor_blocks(old: torch.Tensor, new: torch.Tensor, old_gram: Optional[torch.Tensor] = None,
                  dtype: torch.dtype = torch.float64) -> FactorBlocks:
    """D, C, G of the factor with column blocks `old`, `new` [..., d, h]; G = `old_gram` when given.

    The differences are taken a few heads at a time (cache-sized) and never kept; the d-long products
    run in the inputs' dtype, and the blocks are returned in `dtype` (the small problem's).
    """
    old, new = torch.broadcast_tensors(old, new)
    batch, (d, h) = old.shape[:-2], old.shape[-2:]
    old_rows = old.reshape((-1, d, h)).mT  # [n, h, d]; a view for blocks taken from an [out, in] weight
    new_rows = new.reshape((-1, d, h)).mT
    n = old_rows.shape[0]
    out = old.new_empty((2 if old_gram is not None else 3, n, h, h))
    step = max(1, GRAM_CHUNK_ELEMENTS // (d * h))
    for i in range(0, n, step):
        rows = old_rows[i:i + step].contiguous()
        diff = (new_rows[i:i + step] - rows).contiguous()
        rows_gram(diff, out[0, i:i + step])
        torch.matmul(rows, diff.mT, out=out[1, i:i + step])
        if old_gram is None:
            rows_gram(rows, out[2, i:i + step])
    out = out.to(dtype).reshape((out.shape[0],) + batch + (h, h))
    gram = out[2] if old_gram is None else old_gram.to(dtype).expand(batch + (h, h))
    return FactorBlocks(out[0], out[1], gram)


def _block_matrix(x11: torch.Tensor, x12: torch.Tensor, x22: torch.Tensor) -> torch.Tensor:
    """The symmetric [[x11, x12], [x12ᵀ, x22]] ([..., h, h] blocks of one shape)."""
    h = x11.shape[-1]
    out = x11.new_empty(x11.shape[:-2] + (2 * h, 2 * h))
    out[..., :h, :h] = x11
    out[..., :h, h:] = x12
    out[..., h:, :h] = x12.mT
    out[..., h:, h:] = x22
    return out


def term_grams(query: FactorBlocks, key: FactorBlocks, term: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Grams (AᵀA, BᵀB) of the factors of `term` (increment = A·Bᵀ), from the query's and key's blocks."""
    if term == "delta3":  # ΔWq · ΔWkᵀ
        return query.delta, key.delta
    gram_a = _block_matrix(query.delta, query.cross.mT, query.old)  # A = [ΔWq, Wq]
    if term == "delta2":  # B = [Wk, ΔWk]
        return gram_a, _block_matrix(key.old, key.cross, key.delta)
    # Δ1: B = [Wk', ΔWk] with Wk'ᵀWk' = G', Wk'ᵀΔWk = C + D
    return gram_a, _block_matrix(key.new_gram(), key.cross + key.delta, key.delta)
