"""Spectral statistics of singular spectra, QK-increment spectra through a compressed core, ΔW spectra via Gram.

Everything is batched over leading dimensions and stays on the input's device. No host syncs, except
one flag read by the Gram core of QK increments to route rank-deficient factors to its eigh fallback.
The spectral cores run single-threaded (torch and BLAS, `threads.single_threaded`): their calls are small.
The QK Gram core instead spreads whole heads over the caller's threads (one single-threaded stream each).
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Union

import torch

from mindspeed_proxy.monitor.qk_gram import factor_blocks, rows_gram, term_grams
from mindspeed_proxy.monitor.spectral_routes import lowrank_route, qk_spectra_route, resolve_method
from mindspeed_proxy.monitor.threads import outer_threads, single_threaded

try:  # scipy is an extra: without it the core forms FᵀG_BF by two GEMMs
    from scipy.linalg.lapack import dsygst as _dsygst
except ImportError:  # pragma: no cover - exercised where scipy is absent
    _dsygst = None

TERMS = ("delta1", "delta2", "delta3")
PARALLEL_MIN_ELEMENTS = 1 << 20  # heads·d·h of one QK core call below which its heads stay on one thread
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
    came from to reproduce it exactly), or the `rank` largest values when `rank` is given. σ from a Gram/eigen
    route are noise far above that SVD tolerance: pass that route's floor (`spectral_routes`) as `rank_tol`.
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


def _query_blocks(wq_old, wq_new, term):
    """Column blocks of the query factor A (increment = A·Bᵀ): [ΔWq, Wq_old], or ΔWq for Δ3."""
    dq = wq_new - wq_old
    return (dq,) if term == "delta3" else (dq, wq_old)


def _key_blocks(wk_old, wk_new, term):
    """Column blocks of the key factor B: [Wk_old, ΔWk] (Δ2), [Wk_new, ΔWk] (Δ1), ΔWk (Δ3)."""
    # Δ1 = ΔWq Wk_newᵀ + Wq_old ΔWkᵀ: the same well-conditioned pair as Δ2 (not [Wq_new, Wq_old], whose
    # columns nearly coincide and leave only a ΔW-sized remainder after cancellation).
    dk = wk_new - wk_old
    return (dk,) if term == "delta3" else (wk_new if term == "delta1" else wk_old, dk)


def _rows(x: torch.Tensor) -> torch.Tensor:
    # [..., d, h] -> row-major [..., h, d]; free for blocks viewed from a Megatron [out, in] weight.
    r = x.mT
    return r if r.is_contiguous() else r.contiguous()


def _psd_factor(gram: torch.Tensor, gram_eps: float) -> torch.Tensor:
    """F with F·Fᵀ = gram [..., m, m] (positive semidefinite), jitter-free (see `_psd_factor_checked`)."""
    return _psd_factor_checked(gram, gram_eps)[0]


def _psd_factor_checked(gram: torch.Tensor, gram_eps: float) -> tuple[torch.Tensor, bool]:
    """(F with F·Fᵀ = gram [..., m, m] positive semidefinite, whether every F is lower triangular), jitter-free.

    The Gram is equilibrated to unit diagonal (exactly zero columns get a unit pivot and a zero
    row in F, so ΔW = 0 stays exactly 0) and Cholesky-factored. Where Cholesky fails (a numerically
    rank-deficient factor), F = V·sqrt(λ) from eigh instead, with eigenvalues below
    m·gram_eps·λ_max (the Gram's rounding level) set to 0. Detecting a failure reads one flag on host.
    """
    m = gram.shape[-1]
    scale = gram.diagonal(dim1=-2, dim2=-1).clamp_min(0).sqrt()
    zero = scale == 0
    safe = torch.where(zero, torch.ones_like(scale), scale)
    unit = gram / (safe.unsqueeze(-1) * safe.unsqueeze(-2)) + torch.diag_embed(zero.to(gram.dtype))
    factor, info = torch.linalg.cholesky_ex(unit)
    failed = info != 0
    if bool(failed.any()):
        lam, vec = torch.linalg.eigh(unit[failed])
        lam = torch.where(lam > m * gram_eps * lam.amax(-1, keepdim=True), lam, torch.zeros_like(lam))
        factor = factor.clone()
        factor[failed] = vec * lam.sqrt().unsqueeze(-2)
        return scale.unsqueeze(-1) * factor, False
    return scale.unsqueeze(-1) * factor, True


def uses_sygst(x: torch.Tensor) -> bool:
    """Whether the Gram core forms FᵀG_BF of `x`'s kind (device, dtype) by LAPACK sygst (else by two GEMMs)."""
    return _dsygst is not None and x.device.type == "cpu" and x.dtype == torch.float64


def _congruence(f: torch.Tensor, gram_b: torch.Tensor, lower: bool) -> tuple[torch.Tensor, str]:
    """(Fᵀ·G_B·F [..., m, m], the triangle that holds it: "L" or "U"); leading dims broadcast.

    With a lower-triangular F on CPU in float64, LAPACK's sygst forms it in m³ flops (two GEMMs: 4m³) and
    writes the lower triangle only. The row-major buffers are handed over as their column-major transposes:
    G_B is symmetric, and Fᵀ is the upper factor U of sygst's U·A·Uᵀ (itype 2), so U·G_B·Uᵀ = Fᵀ·G_B·F.
    """
    if not (lower and uses_sygst(f)):
        return f.mT @ gram_b @ f, "U"
    f, gram_b = torch.broadcast_tensors(f, gram_b)
    m = f.shape[-1]
    out = gram_b.reshape(-1, m, m).clone(memory_format=torch.contiguous_format)
    fs = f.reshape(-1, m, m).contiguous().numpy()
    for a, u in zip(out.numpy(), fs):
        _, info = _dsygst(a.T, u.T, itype=2, lower=0, overwrite_a=1)
        if info:
            raise RuntimeError(f"LAPACK dsygst failed (info {info})")
    return out.view(f.shape), "L"


def _gram_core_singular_values(gram_a: torch.Tensor, gram_b: torch.Tensor, gram_eps: float) -> torch.Tensor:
    """σ(A·Bᵀ) descending from G_A = AᵀA, G_B = BᵀB: σ² = eig(Fᵀ G_B F) with F·Fᵀ = G_A (leading dims broadcast)."""
    f, lower = _psd_factor_checked(gram_a, gram_eps)
    core, uplo = _congruence(f, gram_b, lower)
    return torch.linalg.eigvalsh(core, UPLO=uplo).clamp_min(0).sqrt().flip(-1)


def _pad(sv: torch.Tensor, m: int) -> torch.Tensor:
    return torch.nn.functional.pad(sv, (0, m - sv.shape[-1])) if sv.shape[-1] < m else sv


def _direct_singular_values(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # d < m: the d×d product itself is the smaller problem (rank ≤ m: m values, zero-padded).
    m = a.shape[-1]
    return _pad(torch.linalg.svdvals(a @ b.mT)[..., :m], m)


def _small_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.device.type == "mps" else torch.float64  # the m×m problem


@torch.no_grad()
@single_threaded()
def lowrank_product_singular_values(a: torch.Tensor, b: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """Singular values of A·Bᵀ (A, B: [..., d, m]) from m×m Gram or QR cores, never forming d×d; descending, [..., m].

    method "gram": G_A = AᵀA, G_B = BᵀB (GEMMs in the input dtype, a shared B's Gram computed once
    at B's own leading shape), then σ² = eig(Fᵀ G_B F) with F·Fᵀ = G_A, an m×m problem in float64.
    The Gram squares A's conditioning: exactly rank-deficient factors leave spurious values of
    ~sqrt(eps)·‖A‖‖B‖ (≈3e-4 relative in float32): count the rank above `spectral_routes.lowrank_rank_tol`.
    "qr": R_A·R_Bᵀ of thin QRs, accurate to
    ~eps (3× slower on CPU). "auto": "qr" for float64 inputs (reference precision), else "gram".
    Leading dims broadcast. When d < m the d×d product gives d values and the rest are zero-padded.
    """
    m, dtype = a.shape[-1], compute_dtype(a, b)
    route = lowrank_route(a.shape[-2], m, dtype, method)
    if route != "qr":
        a, b = a.to(dtype), b.to(dtype)
        if route == "direct":
            return _direct_singular_values(a, b)
        g_a, g_b = (rows_gram(_rows(x)).to(_small_dtype(x)) for x in (a, b))
        return _gram_core_singular_values(g_a, g_b, torch.finfo(dtype).eps).to(dtype)
    r_a = torch.linalg.qr(a, mode="r").R
    r_b = torch.linalg.qr(b, mode="r").R
    return _pad(torch.linalg.svdvals(r_a @ r_b.mT), m)


@torch.no_grad()
@single_threaded()
def qk_increment_singular_values(
    wq_old: torch.Tensor,
    wk_old: torch.Tensor,
    wq_new: torch.Tensor,
    wk_new: torch.Tensor,
    term: str = "delta2",
    method: str = "auto",
) -> torch.Tensor:
    """Singular values of a QK-operator increment (Δ1, Δ2 or Δ3 of M = W_q W_kᵀ), never forming d×d.

    Inputs are per-head blocks [..., d, h]. Δ1 = M_new − M_old = [ΔWq, Wq_old]·[Wk_new, ΔWk]ᵀ,
    Δ2 = ΔWq Wk_oldᵀ + Wq_old ΔWkᵀ = [ΔWq, Wq_old]·[Wk_old, ΔWk]ᵀ, Δ3 = ΔWq ΔWkᵀ. Returns the
    descending singular values [..., 2h] (Δ3: [..., h]) in at least float32 (bf16/fp16 inputs are
    upcast before the differences are taken). Query and key leading dims broadcast, so under GQA
    the key blocks may carry a size-1 dim where several query heads share one KV group: with
    method "gram" (the default below float64, see `lowrank_product_singular_values`) that group's
    key Gram is then computed once. The Gram blocks are built from the h-column blocks directly
    (`qk_increment_spectra`, which also serves several terms and reuses a previous sample's Gram).
    """
    if term not in TERMS:
        raise ValueError(f"term must be one of {TERMS}, got {term!r}")
    dtype = compute_dtype(wq_old, wk_old, wq_new, wk_new)
    if resolve_method(method, dtype) == "gram":
        return qk_increment_spectra(wq_old, wk_old, wq_new, wk_new, (term,))[0][term]
    q = (wq_old.to(dtype), wq_new.to(dtype))
    k = (wk_old.to(dtype), wk_new.to(dtype))
    cat = (lambda bl: bl[0] if len(bl) == 1 else _hcat(*bl))
    a, b = cat(_query_blocks(*q, term)), cat(_key_blocks(*k, term))
    return lowrank_product_singular_values(a, b, method="qr")


@torch.no_grad()
@single_threaded()
def qk_increment_spectra(
    wq_old: torch.Tensor,
    wk_old: torch.Tensor,
    wq_new: torch.Tensor,
    wk_new: torch.Tensor,
    terms=("delta2",),
    old_grams: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Gram-core singular values of several QK-increment `terms` from one set of blocks, and the new Grams.

    Same inputs and per-term result as `qk_increment_singular_values` (method "gram"): returns
    ({term: σ descending}, (Wq_newᵀWq_new, Wk_newᵀWk_new)), the new Grams [..., h, h] in float64 (MPS:
    float32) at the query's resp. key's own leading shape. Pass them as `old_grams` at a later call
    whose old blocks are exactly this call's new ones: the WᵀW products are then skipped (a quarter
    of the d-long flops) and updated by G' = G + C + Cᵀ + D from blocks computed anyway
    (see `qk_gram`). Each reuse adds one rounding of the h×h sum, so recompute exactly now and then.
    The σ are known above `spectral_routes.qk_spectra_rank_tol` (the Gram core's noise floor).
    """
    bad = [t for t in terms if t not in TERMS]
    if bad:
        raise ValueError(f"terms must be in {TERMS}, got {bad}")
    dtype = compute_dtype(wq_old, wk_old, wq_new, wk_new)
    q = (wq_old.to(dtype), wq_new.to(dtype))
    k = (wk_old.to(dtype), wk_new.to(dtype))
    small = _small_dtype(q[0])
    if qk_spectra_route(*q[0].shape[-2:]) == "direct":  # d < 2h: the d×d products are the smaller problems
        cat = (lambda bl: bl[0] if len(bl) == 1 else _hcat(*bl))
        out = {t: _direct_singular_values(cat(_query_blocks(*q, t)), cat(_key_blocks(*k, t))) for t in terms}
        return out, tuple(rows_gram(_rows(x[1])).to(small) for x in (q, k))
    batch = torch.broadcast_shapes(*(x.shape[:-2] for x in q + k))
    d, h = q[0].shape[-2:]
    # CPU only: an accelerator runs the heads batched already (and a worker thread would not see the caller's stream)
    workers = min(outer_threads(), batch[0]) if batch and q[0].device.type == "cpu" else 1
    if workers > 1 and math.prod(batch) * d * h >= PARALLEL_MIN_ELEMENTS:
        return _parallel_gram_spectra(q, k, terms, old_grams, len(batch), workers)
    return _gram_spectra(q, k, terms, old_grams)


def _gram_spectra(q, k, terms, old_grams):
    """The Gram core of `qk_increment_spectra` on (old, new) query and key blocks of one dtype."""
    small = _small_dtype(q[0])
    old_q, old_k = old_grams if old_grams is not None else (None, None)
    query, key = factor_blocks(*q, old_q, small), factor_blocks(*k, old_k, small)
    eps = torch.finfo(q[0].dtype).eps
    out = {t: _gram_core_singular_values(*term_grams(query, key, t), eps).to(q[0].dtype) for t in terms}
    return out, (query.new_gram(), key.new_gram())


def _split_heads(x: Optional[torch.Tensor], batch_ndim: int, parts: int) -> tuple[list, bool]:
    """`x`'s `parts` slices along the batch's first dim ([x] * parts where x broadcasts there), and whether split."""
    if x is None or x.dim() - 2 < batch_ndim or x.shape[0] == 1:
        return [x] * parts, False
    return list(torch.tensor_split(x, parts, dim=0)), True


def _parallel_gram_spectra(q, k, terms, old_grams, batch_ndim: int, workers: int):
    """`_gram_spectra` with the heads (batch dim 0) split over `workers` threads, each single-threaded inside."""
    old = old_grams if old_grams is not None else (None, None)
    split = [_split_heads(x, batch_ndim, workers) for x in (*q, *k, *old)]

    def part(i):
        """The core on the i-th slice of heads (grad mode is per thread: no_grad again here)."""
        with torch.no_grad():
            grams = None if old_grams is None else (split[4][0][i], split[5][0][i])
            return _gram_spectra((split[0][0][i], split[1][0][i]), (split[2][0][i], split[3][0][i]), terms, grams)

    with ThreadPoolExecutor(workers) as pool:  # torch and numpy release the GIL in their kernels
        results = list(pool.map(part, range(workers)))
    out = {t: torch.cat([r[0][t] for r in results]) for t in terms}
    grams = tuple(torch.cat([r[1][j] for r in results]) if split[2 * j][1] or split[2 * j + 1][1] else results[0][1][j]
                  for j in range(2))
    return out, grams


@torch.no_grad()
@single_threaded()
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
@single_threaded()
def singular_values_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """Singular values (descending) of the matrix whose (summed) Gram is `gram`."""
    return torch.linalg.eigvalsh(gram).clamp_min(0).sqrt().flip(-1)
