"""The route each low-rank spectral core takes (Gram/eigen, direct SVD or QR) and the numerical-rank floor of its σ.

A σ from a direct SVD or from QR then SVD is accurate to ~max(n, d)·eps·σ_max (numpy.linalg.matrix_rank's
tolerance, `spectral_stats`' default). A σ from the Gram route is the square root of an eigenvalue λ = σ² of a
product of Grams formed by d-long dot products in the inputs' dtype: λ carries an absolute error
~max(n, d)·eps·σ_max² (the products, then the n×n eigenproblem), so σ = √λ is only known above
√(max(n, d)·eps)·σ_max. A σ that is zero in exact arithmetic comes out of that route near √eps·σ_max
(about 3e-4·σ_max in float32), far above the SVD tolerance: counted as rank, it would also enter the entropy.
The floors are relative to σ_max, as `spectral_stats`' `rank_tol` takes them.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

METHODS = ("auto", "gram", "qr")


def resolve_method(method: str, dtype: torch.dtype) -> str:
    """The method "auto" stands for at `dtype`: "qr" for float64 (reference precision), else "gram"."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "auto":
        return "qr" if dtype == torch.float64 else "gram"
    return method


def lowrank_route(d: int, m: int, dtype: torch.dtype, method: str = "auto") -> str:
    """The route of `lowrank_product_singular_values` for [..., d, m] factors: "gram", "direct" (SVD of d×d) or "qr"."""
    if resolve_method(method, dtype) == "qr":
        return "qr"
    return "direct" if d < m else "gram"


def qk_spectra_route(d: int, h: int) -> str:
    """The route of `qk_increment_spectra` for [..., d, h] blocks: "gram" (2h×2h core), or "direct" when d < 2h."""
    return "direct" if d < 2 * h else "gram"


def gram_rank_tol(n: int, matrix_dim: int, dtype: torch.dtype) -> float:
    """The relative rank floor √(max(n, matrix_dim)·eps(dtype)) of n values σ = √eig of a Gram (module docstring)."""
    return math.sqrt(max(n, matrix_dim) * torch.finfo(dtype).eps)


def lowrank_rank_tol(d: int, m: int, dtype: torch.dtype, matrix_dim: int = 0,
                     method: str = "auto") -> Optional[float]:
    """The rank floor of `lowrank_product_singular_values`' m values for [..., d, m] factors in `dtype`.

    The Gram floor (`gram_rank_tol` over max(d, matrix_dim)) on its Gram route; None on its SVD and QR routes,
    where `spectral_stats`' default applies. Pass `matrix_dim` as `spectral_stats` gets it.
    """
    if lowrank_route(d, m, dtype, method) != "gram":
        return None
    return gram_rank_tol(m, max(d, matrix_dim), dtype)


def qk_spectra_rank_tol(d: int, h: int, dtype: torch.dtype, term: str, matrix_dim: int = 0) -> Optional[float]:
    """The rank floor of `qk_increment_spectra`' σ of `term` for [..., d, h] blocks in `dtype` (None: SVD's default)."""
    if qk_spectra_route(d, h) != "gram":
        return None
    return gram_rank_tol(h if term == "delta3" else 2 * h, max(d, matrix_dim), dtype)
