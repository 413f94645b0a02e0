"""Per-layer expert similarity (E x E) from features that never sit in memory whole.

`weights` (data-free): each expert's flattened weights (all TP pieces) and its router row, compared by
cosine similarity. The Gram matrix is accumulated over column blocks of the flattened weights, so
only an E x block slice is ever materialised; weights and router row get equal say (each part is
unit-normalised before they are combined).
"""
from __future__ import annotations

import numpy as np
import torch

BLOCK_BYTES = 64 << 20


def _cosine(gram: np.ndarray) -> np.ndarray:
    norms = np.sqrt(np.clip(np.diag(gram), 1e-300, None))
    return gram / np.outer(norms, norms)


def streamed_gram(rows: list, block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    """X Xᵀ (float64) for X whose row i is `rows[i]` flattened, accumulated one column block at a time."""
    n = len(rows)
    flat = [r.reshape(-1) for r in rows]
    length = flat[0].numel()
    if any(f.numel() != length for f in flat):
        raise ValueError("experts of one layer have different sizes")
    block = max(1, block_bytes // (8 * n))
    gram = torch.zeros(n, n, dtype=torch.float64)
    for start in range(0, length, block):
        chunk = torch.stack([f[start:start + block].to(torch.float64) for f in flat])
        gram += chunk @ chunk.T
    return gram.numpy()


def weight_similarity(ckpt, layer) -> np.ndarray:
    """E x E cosine similarity of `layer`'s experts: flattened weights (+) router rows, equally weighted."""
    L = ckpt.layout
    gram = np.zeros((L.num_experts, L.num_experts))
    for tp in ([0] if L.tp_extend_ep else range(L.tp)):
        names = sorted(n for n, v in ckpt.expert(layer, 0, tp).items() if isinstance(v, torch.Tensor))
        for name in names:
            gram += streamed_gram([ckpt.expert(layer, g, tp)[name] for g in range(L.num_experts)])
    router = ckpt.router(layer)["weight"].to(torch.float64)
    return similarity_from_parts([gram, (router @ router.T).numpy()])


def similarity_from_parts(grams: list) -> np.ndarray:
    """Mean of the parts' cosine matrices (= cosine of the concatenated unit-normalised parts)."""
    sim = sum(_cosine(g) for g in grams) / len(grams)
    sim = (sim + sim.T) / 2
    np.fill_diagonal(sim, 1.0)
    return np.clip(sim, -1.0, 1.0)


def similarity_from_vectors(vectors: np.ndarray) -> np.ndarray:
    """Cosine similarity of the rows of `vectors` (E x D), e.g. mean expert outputs on calibration tokens."""
    v = np.asarray(vectors, dtype=np.float64)
    return similarity_from_parts([v @ v.T])
