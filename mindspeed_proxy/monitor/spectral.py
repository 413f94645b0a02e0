"""Spectral statistics of singular spectra, QK-increment spectra through a compressed core, ΔW spectra via Gram.

Everything is batched over leading dimensions and stays on the input's device; no host syncs.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

TERMS = ("delta1", "delta2", "delta3")
PARALLEL_MODES = (None, "column", "row")


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """Return the promoted floating dtype of `tensors`, at least float32 (bf16/fp16 are upcast)."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if not dtype.is_floating_point:
        return torch.float32
    return torch.promote_types(dtype, torch.float32)


@torch.no_grad()
def spectral_stats(
    singular_values: torch.Tensor,
    alpha: float = 2.0,
    rank_tol: Optional[float] = None,
    rank: Optional[Union[int, torch.Tensor]] = None,
    matrix_dim: Optional[int] = None,
) -> dict[str, torch.Tensor]:
    """Spectral entropy, normalised entropy, effective/stable rank, Frobenius norm, top-1 energy of σ[..., n].

    Only the numerical-rank values enter the distribution p_i = σ_i^α / Σ_j σ_j^α:
    σ_i > rank_tol · σ_max, with rank_tol defaulting to max(n, matrix_dim) · eps(dtype) as
    numpy.linalg.matrix_rank does (pass `matrix_dim` = the larger side of the matrix the values
    came from to reproduce it exactly), or the `rank` largest values when `rank` is given.
    Values are computed in at least float32. Returned keys, each of shape [...]:

    - entropy H = −Σ p log p;  normalized_entropy = H / log r, defined 0 when r ≤ 1;
    - effective_rank = exp(H) (0 for an all-zero spectrum);  numerical_rank r;
    - stable_rank = Σσ² / σ_max²;  frobenius = sqrt(Σσ²);  top1_energy = σ_max² / Σσ².

    An all-zero spectrum gives 0 for every statistic (no NaN). A spectrum with a NaN or Inf gives NaN
    for every float statistic, so the detector's non-finite alert fires.
    """
    s = singular_values.to(compute_dtype(singular_values)).clamp_min(0)
    n = s.shape[-1]
    smax = s.amax(dim=-1, keepdim=True)
    # Normalising by σ_max makes σ^α and σ² overflow/underflow-safe and scale-free.
    sn = s / torch.where(smax > 0, smax, torch.ones_like(smax))

    if rank is not None:
        order = torch.arange(n, device=s.device)
        rank_t = torch.as_tensor(rank, device=s.device)
        sorted_desc = torch.sort(sn, dim=-1, descending=True)
        keep_sorted = (order < rank_t.unsqueeze(-1)) & (sorted_desc.values > 0)
        mask = torch.zeros_like(keep_sorted).scatter(-1, sorted_desc.indices, keep_sorted)
    else:
        tol = rank_tol if rank_tol is not None else max(n, matrix_dim or 0) * torch.finfo(s.dtype).eps
        mask = sn > tol

    r = mask.sum(dim=-1)
    weights = torch.where(mask, sn.pow(alpha), torch.zeros_like(sn))
    total = weights.sum(dim=-1, keepdim=True)
    p = weights / torch.where(total > 0, total, torch.ones_like(total))
    entropy = torch.special.entr(p).sum(dim=-1)

    log_r = torch.log(r.clamp_min(2).to(s.dtype))
    normalized = torch.where(r > 1, entropy / log_r, torch.zeros_like(entropy))
    effective_rank = torch.where(r > 0, torch.exp(entropy), torch.zeros_like(entropy))

    energy = sn.square().sum(dim=-1)  # Σσ² / σ_max², 0 for the zero spectrum
    smax = smax.squeeze(-1)
    nonzero = energy > 0
    top1 = torch.where(nonzero, 1.0 / torch.where(nonzero, energy, torch.ones_like(energy)),
                       torch.zeros_like(energy))
    stats = {
        "entropy": entropy,
        "normalized_entropy": normalized,
        "effective_rank": effective_rank,
        "stable_rank": energy,
        "frobenius": smax * energy.sqrt(),
        "top1_energy": top1,
    }
    finite = torch.isfinite(s).all(dim=-1)
    stats = {k: torch.where(finite, v, torch.full_like(v, float("nan"))) for k, v in stats.items()}
    stats["numerical_rank"] = r
    return stats


def _hcat(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Concatenate columns into a column-major (LAPACK/cuSOLVER layout) [..., d, 2h]: QR then skips a
    # transposing copy, and blocks taken from a Megatron [out, in] weight (.mT views) copy straight in.
    x, y = torch.broadcast_tensors(x, y)
    return torch.cat([x.mT, y.mT], dim=-2).mT


def _factor_pair(wq_old, wk_old, wq_new, wk_new, term):
    if term == "delta2":
        return _hcat(wq_new - wq_old, wq_old), _hcat(wk_old, wk_new - wk_old)
    if term == "delta3":
        return wq_new - wq_old, wk_new - wk_old
    if term == "delta1":
        return _hcat(wq_new, wq_old), _hcat(wk_new, -wk_old)
    raise ValueError(f"term must be one of {TERMS}, got {term!r}")


@torch.no_grad()
def lowrank_product_singular_values(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Singular values of A·Bᵀ (A, B: [..., d, m]) from the m×m core R_A·R_Bᵀ of thin QRs, descending, [..., m].

    Leading dims broadcast (the QR of a shared B is done once). When d < m the d×d core gives d
    values and the rest are zero-padded.
    """
    r_a = torch.linalg.qr(a, mode="r").R
    r_b = torch.linalg.qr(b, mode="r").R
    sv = torch.linalg.svdvals(r_a @ r_b.mT)
    m = a.shape[-1]
    if sv.shape[-1] < m:
        sv = torch.nn.functional.pad(sv, (0, m - sv.shape[-1]))
    return sv


@torch.no_grad()
def qk_increment_singular_values(
    wq_old: torch.Tensor,
    wk_old: torch.Tensor,
    wq_new: torch.Tensor,
    wk_new: torch.Tensor,
    term: str = "delta2",
) -> torch.Tensor:
    """Singular values of a QK-operator increment (Δ1, Δ2 or Δ3 of M = W_q W_kᵀ), never forming d×d.

    Inputs are per-head blocks [..., d, h]. Δ1 = M_new − M_old = [Wq_new, Wq_old]·[Wk_new, −Wk_old]ᵀ,
    Δ2 = ΔWq Wk_oldᵀ + Wq_old ΔWkᵀ = [ΔWq, Wq_old]·[Wk_old, ΔWk]ᵀ, Δ3 = ΔWq ΔWkᵀ. Returns the
    descending singular values [..., 2h] (Δ3: [..., h]) in at least float32 (bf16/fp16 inputs are
    upcast before the differences are taken). Query and key leading dims broadcast, so under GQA
    the key blocks may carry a size-1 dim where several query heads share one KV group.
    """
    dtype = compute_dtype(wq_old, wk_old, wq_new, wk_new)
    a, b = _factor_pair(wq_old.to(dtype), wk_old.to(dtype), wq_new.to(dtype), wk_new.to(dtype), term)
    return lowrank_product_singular_values(a, b)


@torch.no_grad()
def update_singular_values(
    delta: torch.Tensor,
    group=None,
    parallel_mode: Optional[str] = None,
    gram_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Singular values of ΔW [..., out, in] (descending) from the eigenvalues of a Gram matrix, TP-aware.

    parallel_mode None: the Gram of the smaller side, no communication. "column" (output rows
    sharded, ΔW = vstack of shards): the in×in Gram ΔWᵀΔW = Σ_r ΔW_rᵀΔW_r is all-reduced over
    `group`; "row" (input columns sharded, ΔW = hstack): the out×out Gram ΔWΔWᵀ. Only those sides
    reduce by a sum, so the smaller-side rule does not apply when sharded. The all-reduce is
    skipped when torch.distributed is not initialised; `group=None` then means the default group.
    Returns min(out, in) values (column/row: in resp. out values, zeros beyond the rank).

    Precision: eigenvalues of a Gram have absolute error ~eps·σ_max², so values below
    ~sqrt(eps)·σ_max (≈3e-4·σ_max in float32) are unreliable; with α = 2 weighting they move the
    entropy by O(eps). gram_dtype=torch.float64 lowers that floor to ~1.5e-8·σ_max where float64
    is cheap (GPU; not NPU).
    """
    gram = update_gram(delta, parallel_mode, gram_dtype)
    if parallel_mode is not None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(gram, op=dist.ReduceOp.SUM, group=group)
    return singular_values_from_gram(gram)


@torch.no_grad()
def update_gram(delta: torch.Tensor, parallel_mode: Optional[str] = None,
                gram_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """This rank's Gram of ΔW [..., out, in]: in×in for "column" shards, out×out for "row", else the small side."""
    if parallel_mode not in PARALLEL_MODES:
        raise ValueError(f"parallel_mode must be one of {PARALLEL_MODES}, got {parallel_mode!r}")
    x = delta.to(gram_dtype or compute_dtype(delta))
    out_dim, in_dim = x.shape[-2], x.shape[-1]
    use_in_side = parallel_mode == "column" or (parallel_mode is None and in_dim <= out_dim)
    return x.mT @ x if use_in_side else x @ x.mT


@torch.no_grad()
def singular_values_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """Singular values (descending) of the matrix whose (summed) Gram is `gram`."""
    return torch.linalg.eigvalsh(gram).clamp_min(0).sqrt().flip(-1)
