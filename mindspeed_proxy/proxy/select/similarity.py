"""Per-layer expert similarity (E x E) from features that never sit in memory whole.

`weights` (data-free): each expert's flattened weights (all TP pieces) and its router row, compared by
cosine similarity. The Gram matrix is accumulated over column blocks of the flattened weights, so
only an E x block slice is ever materialised (float32 products over 8192 columns at a time, summed in
float64: ~1e-7 relative to the float64 Gram); weights and router row get equal say (each part is
unit-normalised before they are combined).
`outputs` and features FILEs give one vector per expert ([E, D]), compared by cosine similarity
(`similarity_from_vectors`); a FILE is read and validated by `read_features_file`.
"""
from __future__ import annotations

import numpy as np

PRODUCT_COLUMNS = 8192  # float32 products run over at most this many columns before float64 accumulation


def _cosine(gram: np.ndarray) -> np.ndarray:
    norms = np.sqrt(np.clip(np.diag(gram), 1e-300, None))
    return gram / np.outer(norms, norms)


def block_gram(block: np.ndarray, columns: int = PRODUCT_COLUMNS) -> np.ndarray:
    """block @ blockᵀ as float64, from products over at most `columns` columns in the block's own dtype."""
    out = np.zeros((block.shape[0], block.shape[0]))
    for start in range(0, block.shape[1], columns):
        part = block[:, start:start + columns]
        out += part @ part.T  # float32: one BLAS syrk per slice; the running sum is float64
    return out


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
