"""Spectral monitor math against independent float64 dense references (numpy SVD of formed matrices)."""
import numpy as np
import pytest
import torch

from mindspeed_proxy.monitor.spectral import (
    qk_increment_singular_values,
    update_gram,
    spectral_stats,
    update_singular_values,
)

TOL = {torch.float64: 1e-5, torch.float32: 1e-3}


def spectrum_error(got, ref):
    """Max abs difference of two descending spectra, relative to the reference's largest value."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape
    return np.abs(got - ref).max() / ref.max()


def dense_increment_sv(wq_old, wk_old, wq_new, wk_new, term):
    """Reference: form the d×d increment in float64 and take numpy's full SVD."""
    q0, k0, q1, k1 = (np.asarray(w, dtype=np.float64) for w in (wq_old, wk_old, wq_new, wk_new))
    if term == "delta1":
        mat = q1 @ k1.T - q0 @ k0.T
    elif term == "delta2":
        mat = (q1 - q0) @ k0.T + q0 @ (k1 - k0).T
    else:
        mat = (q1 - q0) @ (k1 - k0).T
    return np.linalg.svd(mat, compute_uv=False)


def random_blocks(gen, d, h, scale=1e-2, dtype=torch.float64):
    wq = torch.randn(d, h, generator=gen, dtype=torch.float64)
    wk = torch.randn(d, h, generator=gen, dtype=torch.float64)
    dq = scale * torch.randn(d, h, generator=gen, dtype=torch.float64)
    dk = scale * torch.randn(d, h, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (wq, wk, wq + dq, wk + dk)]


@pytest.mark.parametrize("term", ["delta1", "delta2", "delta3"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_qk_increment_matches_dense_svd(term, dtype):
    gen = torch.Generator().manual_seed(0)
    d, h = 48, 6
    blocks = random_blocks(gen, d, h, dtype=dtype)
    got = qk_increment_singular_values(*blocks, term=term)
    width = h if term == "delta3" else 2 * h
    assert got.shape == (width,) and got.dtype == dtype
    ref = dense_increment_sv(*[b.double() for b in blocks], term)
    assert spectrum_error(got, ref[:width]) <= TOL[dtype]
    assert ref[width:].max() <= 1e-10 * ref[0]  # the compressed width holds the whole nonzero spectrum


@pytest.mark.parametrize("term", ["delta1", "delta2", "delta3"])
def test_qk_increment_rank_deficient(term):
    gen = torch.Generator().manual_seed(1)
    d, h = 40, 8
    wq = torch.randn(d, 3, generator=gen, dtype=torch.float64) @ torch.randn(3, h, generator=gen, dtype=torch.float64)
    wk = torch.randn(d, h, generator=gen, dtype=torch.float64)
    u = torch.randn(d, 1, generator=gen, dtype=torch.float64)
    v = torch.randn(1, h, generator=gen, dtype=torch.float64)
    wq_new = wq + 1e-3 * u @ v  # rank-1 query update, keys move only in a rank-2 subspace
    wk_new = wk + 1e-3 * torch.randn(d, 2, generator=gen, dtype=torch.float64) @ torch.randn(
        2, h, generator=gen, dtype=torch.float64)
    got = qk_increment_singular_values(wq, wk, wq_new, wk_new, term=term)
    ref = dense_increment_sv(wq, wk, wq_new, wk_new, term)[: got.shape[-1]]
    assert spectrum_error(got, ref) <= 1e-10
    # Δ1 = ΔWq Wk_newᵀ + Wq ΔWkᵀ and Δ2 have rank 1 + 2; Δ3 = rank-1 · rank-2 has rank 1
    expected_rank = {"delta1": 3, "delta2": 3, "delta3": 1}[term]
    assert int((got > 1e-9 * got[0]).sum()) == expected_rank


def test_qk_increment_keys_frozen_gives_query_only_rank():
    gen = torch.Generator().manual_seed(2)
    wq, wk, wq_new, _ = random_blocks(gen, 32, 4)
    got = qk_increment_singular_values(wq, wk, wq_new, wk, term="delta2")
    ref = np.linalg.svd((wq_new - wq).numpy() @ wk.numpy().T, compute_uv=False)[:8]
    assert spectrum_error(got, ref) <= 1e-10
    assert got[4:].abs().max() <= 1e-12 * got[0]
    assert torch.count_nonzero(qk_increment_singular_values(wq, wk, wq_new, wk, term="delta3")) == 0


def test_qk_increment_gqa_broadcast_and_batch():
    gen = torch.Generator().manual_seed(3)
    n_kv, group, d, h = 2, 3, 40, 5
    wq = torch.randn(n_kv, group, d, h, generator=gen, dtype=torch.float64)
    wk = torch.randn(n_kv, 1, d, h, generator=gen, dtype=torch.float64)
    wq_new = wq + 1e-2 * torch.randn(wq.shape, generator=gen, dtype=torch.float64)
    wk_new = wk + 1e-2 * torch.randn(wk.shape, generator=gen, dtype=torch.float64)
    for term in ("delta1", "delta2", "delta3"):
        got = qk_increment_singular_values(wq, wk, wq_new, wk_new, term=term)
        assert got.shape[:2] == (n_kv, group)
        for g in range(n_kv):
            for j in range(group):  # each query head against its group's shared key block
                ref = dense_increment_sv(wq[g, j], wk[g, 0], wq_new[g, j], wk_new[g, 0], term)
                assert spectrum_error(got[g, j], ref[: got.shape[-1]]) <= 1e-10
    explicit = qk_increment_singular_values(wq, wk.expand_as(wq), wq_new, wk_new.expand_as(wq_new))
    assert torch.allclose(explicit, qk_increment_singular_values(wq, wk, wq_new, wk_new), rtol=1e-12, atol=0)


def test_qk_increment_low_precision_inputs_upcast():
    gen = torch.Generator().manual_seed(4)
    blocks = [b.to(torch.bfloat16) for b in random_blocks(gen, 64, 8, scale=5e-2)]
    old_fp32 = [blocks[0].float(), blocks[1].float()]  # fp32 snapshot vs bf16 live weights
    got = qk_increment_singular_values(old_fp32[0], old_fp32[1], blocks[2], blocks[3])
    assert got.dtype == torch.float32
    ref = dense_increment_sv(*[b.double() for b in blocks], "delta2")[:16]
    assert spectrum_error(got, ref) <= TOL[torch.float32]
    assert qk_increment_singular_values(*blocks).dtype == torch.float32


def test_qk_increment_short_blocks_are_zero_padded():
    gen = torch.Generator().manual_seed(5)
    blocks = random_blocks(gen, 6, 4)  # d < 2h: rank ≤ d
    got = qk_increment_singular_values(*blocks)
    assert got.shape == (8,)
    ref = dense_increment_sv(*blocks, "delta2")
    assert spectrum_error(got[:6], ref) <= 1e-10
    assert torch.all(got[6:] == 0)


def test_qk_increment_rejects_unknown_term():
    blocks = random_blocks(torch.Generator().manual_seed(0), 8, 2)
    with pytest.raises(ValueError):
        qk_increment_singular_values(*blocks, term="delta4")


@pytest.mark.parametrize("shape", [(30, 12), (12, 30), (3, 20, 20)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_update_singular_values_matches_svd(shape, dtype):
    gen = torch.Generator().manual_seed(6)
    delta = torch.randn(shape, generator=gen, dtype=torch.float64)
    got = update_singular_values(delta.to(dtype))
    assert got.shape == shape[:-2] + (min(shape[-2:]),)
    ref = np.linalg.svd(delta.numpy(), compute_uv=False)
    for g, r in zip(got.reshape(-1, got.shape[-1]), ref.reshape(-1, ref.shape[-1])):
        assert spectrum_error(g, r) <= TOL[dtype] / 10
    assert torch.all(got[..., :-1] >= got[..., 1:])


@pytest.mark.parametrize("mode,side", [("column", 1), ("row", 0)])
def test_update_singular_values_forced_side_without_distributed(mode, side):
    gen = torch.Generator().manual_seed(7)
    delta = torch.randn(10, 7, generator=gen, dtype=torch.float64)
    got = update_singular_values(delta, parallel_mode=mode)
    assert got.shape == (delta.shape[side],)
    ref = np.linalg.svd(delta.numpy(), compute_uv=False)
    assert spectrum_error(got[:7], ref) <= 1e-10
    assert got[7:].abs().max() <= 1e-6 * got[0] if got.shape[0] > 7 else True


def test_update_singular_values_low_rank_fp32_and_gram_dtype():
    gen = torch.Generator().manual_seed(8)
    delta = torch.randn(64, 2, generator=gen) @ torch.randn(2, 48, generator=gen)  # rank 2
    got = update_singular_values(delta)
    assert torch.all(got >= 0) and torch.isfinite(got).all()
    ref = np.linalg.svd(delta.double().numpy(), compute_uv=False)
    assert spectrum_error(got, ref) <= 1e-3
    exact = update_singular_values(delta, gram_dtype=torch.float64)
    assert exact.dtype == torch.float64 and spectrum_error(exact, ref) <= 1e-7  # ~sqrt(eps64)
    with pytest.raises(ValueError):
        update_singular_values(delta, parallel_mode="diagonal")


def numpy_stats(s, alpha=2.0, tol=None):
    s = np.asarray(s, dtype=np.float64)
    tol = len(s) * np.finfo(np.float64).eps if tol is None else tol
    nz = s[s > tol * s.max()]
    p = nz ** alpha / np.sum(nz ** alpha)
    entropy = -np.sum(p * np.log(p))
    r = len(nz)
    return {
        "entropy": entropy,
        "normalized_entropy": entropy / np.log(r) if r > 1 else 0.0,
        "effective_rank": np.exp(entropy),
        "stable_rank": np.sum(s ** 2) / s.max() ** 2,
        "frobenius": np.sqrt(np.sum(s ** 2)),
        "top1_energy": s.max() ** 2 / np.sum(s ** 2),
        "numerical_rank": r,
    }


@pytest.mark.parametrize("alpha", [2.0, 1.0])
def test_spectral_stats_matches_numpy_formulas(alpha):
    rng = np.random.default_rng(9)
    values = np.sort(rng.gamma(0.7, size=(3, 4, 16)), axis=-1)[..., ::-1].copy()
    values[0, 1, 10:] = 0.0  # a few exact zeros
    values[2, 3, 5:] = 1e-20  # below the numerical-rank tolerance
    got = spectral_stats(torch.from_numpy(values), alpha=alpha)
    for idx in np.ndindex(3, 4):
        ref = numpy_stats(values[idx], alpha)
        for key, expected in ref.items():
            assert got[key][idx].item() == pytest.approx(expected, rel=1e-10), key
    fp32 = spectral_stats(torch.from_numpy(values).float(), alpha=alpha)
    for key in ("entropy", "effective_rank", "stable_rank", "top1_energy"):
        assert np.allclose(fp32[key].numpy(), got[key].numpy(), rtol=1e-5, atol=0)


def test_spectral_stats_order_and_scale_invariance():
    rng = np.random.default_rng(10)
    s = torch.from_numpy(rng.random(12))
    base = spectral_stats(s)
    shuffled = spectral_stats(s[torch.randperm(12)])
    huge = spectral_stats((s * 1e30).float())  # σ² overflows float32 unless normalised first
    for key in ("entropy", "normalized_entropy", "effective_rank", "stable_rank", "top1_energy"):
        assert shuffled[key].item() == pytest.approx(base[key].item(), rel=1e-12)
        assert huge[key].item() == pytest.approx(base[key].item(), rel=1e-5)
    assert huge["frobenius"].item() == pytest.approx(1e30 * base["frobenius"].item(), rel=1e-5)


def test_spectral_stats_edge_cases_are_finite():
    zero = spectral_stats(torch.zeros(2, 5))
    for key, value in zero.items():
        assert torch.all(value == 0), key
    one = spectral_stats(torch.tensor([3.0, 0.0, 0.0]))
    assert one["entropy"].item() == 0 and one["normalized_entropy"].item() == 0
    assert one["effective_rank"].item() == 1 and one["stable_rank"].item() == 1
    assert one["top1_energy"].item() == 1 and one["frobenius"].item() == 3
    bad = spectral_stats(torch.tensor([[1.0, float("nan")], [float("inf"), 1.0], [2.0, 1.0]]))
    for key, value in bad.items():
        if key != "numerical_rank":
            assert torch.isnan(value[:2]).all() and torch.isfinite(value[2]), key
    flat = spectral_stats(torch.ones(8, dtype=torch.float64))
    assert flat["normalized_entropy"].item() == pytest.approx(1.0, rel=1e-12)
    assert flat["effective_rank"].item() == pytest.approx(8.0, rel=1e-12)


def test_spectral_stats_rank_and_tolerance_controls():
    s = torch.tensor([1.0, 0.5, 1e-5, 1e-6], dtype=torch.float32)
    assert spectral_stats(s)["numerical_rank"].item() == 4  # 4·eps(fp32) ≈ 5e-7
    assert spectral_stats(s, matrix_dim=4096)["numerical_rank"].item() == 2  # numpy's max(M, N)·eps
    assert spectral_stats(s, rank_tol=1e-3)["numerical_rank"].item() == 2
    top2 = spectral_stats(s, rank=2)
    ref = numpy_stats([1.0, 0.5], tol=0.0)
    assert top2["numerical_rank"].item() == 2
    assert top2["entropy"].item() == pytest.approx(ref["entropy"], rel=1e-6)
    batched = spectral_stats(torch.stack([s, s.flip(0)]), rank=torch.tensor([1, 2]))
    assert batched["numerical_rank"].tolist() == [1, 2]
    assert batched["entropy"][0].item() == 0
    assert batched["entropy"][1].item() == pytest.approx(ref["entropy"], rel=1e-6)


def test_qk_increment_accepts_megatron_weight_views():
    gen = torch.Generator().manual_seed(11)
    heads, h, d = 3, 4, 24
    weights = [torch.randn(heads * h, d, generator=gen, dtype=torch.float64) for _ in range(2)]
    steps = [w + 1e-2 * torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in weights]
    views = [w.view(heads, h, d).mT for w in (weights[0], weights[1], steps[0], steps[1])]  # [heads, d, h]
    got = qk_increment_singular_values(*views)
    assert torch.equal(got, qk_increment_singular_values(*[v.contiguous() for v in views]))
    for i in range(heads):
        ref = dense_increment_sv(*[v[i] for v in views], "delta2")[: 2 * h]
        assert spectrum_error(got[i], ref) <= 1e-10


def test_spectral_functions_do_not_track_gradients():
    blocks = [torch.nn.Parameter(b) for b in random_blocks(torch.Generator().manual_seed(12), 16, 2)]
    assert not qk_increment_singular_values(*blocks).requires_grad
    assert not update_singular_values(blocks[2] - blocks[0]).requires_grad


# --- Gram core (method "gram", the default below float64) against float64 dense SVDs --------------------

from mindspeed_proxy.monitor.spectral import _psd_factor  # noqa: E402


def relative_errors(got, ref, d):
    """(max per-value relative error over the values above fp32 rank tolerance, entropy relative error)."""
    got, ref = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(ref, dtype=torch.float64)
    keep = ref > max(ref.shape[-1], d) * torch.finfo(torch.float32).eps * ref.max()
    rel = ((got - ref).abs() / ref.clamp_min(1e-300))[keep].max().item()
    ent, ent_ref = (spectral_stats(x, matrix_dim=d)["entropy"].item() for x in (got, ref))
    return rel, abs(ent - ent_ref) / ent_ref


@pytest.mark.parametrize("term", ["delta1", "delta2", "delta3"])
@pytest.mark.parametrize("scale", [1e-2, 1e-4])
def test_gram_core_fp32_matches_float64_dense(term, scale):
    gen = torch.Generator().manual_seed(20)
    d, h = 256, 16
    blocks = random_blocks(gen, d, h, scale=scale, dtype=torch.float32)
    got = qk_increment_singular_values(*blocks, term=term)
    assert got.dtype == torch.float32
    assert torch.equal(got, qk_increment_singular_values(*blocks, term=term, method="gram"))
    ref = dense_increment_sv(*[b.double() for b in blocks], term)[: got.shape[-1]]
    rel, ent = relative_errors(got, ref, d)
    assert rel <= 1e-4 and ent <= 1e-5, (rel, ent)
    qr = qk_increment_singular_values(*blocks, term=term, method="qr")
    assert relative_errors(qr, ref, d)[0] <= 1e-3  # the two methods agree with the same reference


def test_gram_core_float64_inputs_match_dense():
    gen = torch.Generator().manual_seed(21)
    blocks = random_blocks(gen, 64, 8)
    got = qk_increment_singular_values(*blocks, method="gram")
    assert got.dtype == torch.float64
    assert spectrum_error(got, dense_increment_sv(*blocks, "delta2")[:16]) <= 1e-12


def test_gram_core_zero_update_is_exactly_zero():
    gen = torch.Generator().manual_seed(22)
    wq, wk, wq_new, wk_new = random_blocks(gen, 128, 8, dtype=torch.float32)
    for term in ("delta1", "delta2", "delta3"):  # first sample: W_new == W_old
        assert torch.count_nonzero(qk_increment_singular_values(wq, wk, wq, wk, term=term)) == 0
    assert all(v.item() == 0 for v in spectral_stats(qk_increment_singular_values(wq, wk, wq, wk)).values())
    # keys frozen: Δ2 = ΔWq Wkᵀ has rank h, the other h values are exactly zero; Δ3 = 0
    got = qk_increment_singular_values(wq, wk, wq_new, wk)
    ref = np.linalg.svd((wq_new.double() - wq.double()).numpy() @ wk.double().numpy().T, compute_uv=False)[:8]
    assert relative_errors(got[:8], ref, 128)[0] <= 1e-4
    assert torch.count_nonzero(got[8:]) == 0
    assert torch.count_nonzero(qk_increment_singular_values(wq, wk, wq_new, wk, term="delta3")) == 0


def test_gram_core_tiny_updates_delta3():
    gen = torch.Generator().manual_seed(23)
    d, h = 192, 12
    # ΔW of ~1 fp32 ulp of W (1e-7 relative), and a tiny-magnitude layer (W ~1e-8, ΔW ~1e-15)
    for w_scale, rel_step in ((1e-2, 1e-7), (1e-8, 1e-7), (1.0, 1e-5)):
        wq, wk = (w_scale * torch.randn(d, h, generator=gen) for _ in range(2))
        wq_new, wk_new = ((w.double() + rel_step * w_scale * torch.randn(d, h, generator=gen, dtype=torch.float64)
                           ).float() for w in (wq, wk))
        blocks = [wq, wk, wq_new, wk_new]  # the reference sees the same (exactly representable) fp32 differences
        assert torch.count_nonzero(wq_new - wq) > d * h // 2
        for term in ("delta3", "delta2"):
            got = qk_increment_singular_values(*blocks, term=term)
            ref = dense_increment_sv(*[b.double() for b in blocks], term)[: got.shape[-1]]
            rel, ent = relative_errors(got, ref, d)
            assert rel <= 1e-4 and ent <= 1e-5, (w_scale, rel_step, term, rel, ent)


def test_psd_factor_rank_deficient_falls_back_without_jitter():
    good = torch.tensor([[4.0, 2.0, 0.0], [2.0, 5.0, 1.0], [0.0, 1.0, 3.0]], dtype=torch.float64)
    bad = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 4.0]], dtype=torch.float64)  # pivot 2 is 0
    zero_col = torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.0, 1.0], [0.0, 1.0, 2.0]], dtype=torch.float64)
    assert torch.linalg.cholesky_ex(bad).info.item() != 0
    grams = torch.stack([good, bad, zero_col])
    f = _psd_factor(grams, torch.finfo(torch.float64).eps)
    assert torch.allclose(f @ f.mT, grams, atol=1e-12, rtol=0)
    assert torch.allclose(f[0], torch.linalg.cholesky(good), rtol=1e-14, atol=0)  # Cholesky where it succeeds
    assert torch.count_nonzero(f[0].triu(1)) == 0
    assert torch.linalg.matrix_rank(f[1]).item() == 2  # exact rank kept: no jitter on the null direction
    assert torch.count_nonzero(f[2][0]) == 0  # a zero column gives an exactly zero row


def test_gram_core_rank_deficient_query_factor():
    # weight-decay-like update ΔWq = −Wq/2 (exact in binary): A = [ΔWq, Wq] has rank h, its Cholesky fails
    gen = torch.Generator().manual_seed(24)
    d, h = 160, 8
    wq, wk, _, wk_new = random_blocks(gen, d, h, dtype=torch.float32)
    wq_new = wq * 0.5
    got = qk_increment_singular_values(wq, wk, wq_new, wk_new)
    ref = dense_increment_sv(*[b.double() for b in (wq, wk, wq_new, wk_new)], "delta2")[: 2 * h]
    assert ref[h] <= 1e-12 * ref[0]  # Δ2 = Wq (Wk/2 − ΔWk)ᵀ... rank h
    rel, ent = relative_errors(got[:h], ref[:h], d)
    assert rel <= 1e-4 and ent <= 1e-5
    assert got[h:].max() <= 1e-6 * got[0]
    assert spectral_stats(got, matrix_dim=d)["numerical_rank"].item() == h
    # a rank-3 query weight (d×h of rank 3): Δ2 rank ≤ 3 + h from the key update
    wq3 = (torch.randn(d, 3, generator=gen) @ torch.randn(3, h, generator=gen)).float()
    blocks = [wq3, wk, wq3 + 1e-3 * torch.randn(d, h, generator=gen), wk_new]
    got = qk_increment_singular_values(*blocks)
    ref = dense_increment_sv(*[b.double() for b in blocks], "delta2")[: 2 * h]
    top = int((ref > 1e-3 * ref[0]).sum())
    assert relative_errors(got[:top], ref[:top], d)[0] <= 1e-4
    assert spectrum_error(got, ref) <= 1e-3  # spurious values stay at the documented sqrt(eps) floor


def test_gram_core_gqa_shared_key_gram_and_batch():
    gen = torch.Generator().manual_seed(25)
    n_kv, group, d, h = 2, 4, 96, 6
    wq = torch.randn(n_kv, group, d, h, generator=gen)
    wk = torch.randn(n_kv, 1, d, h, generator=gen)
    wq_new = wq + 1e-3 * torch.randn(wq.shape, generator=gen)
    wk_new = wk + 1e-3 * torch.randn(wk.shape, generator=gen)
    for term in ("delta1", "delta2", "delta3"):
        got = qk_increment_singular_values(wq, wk, wq_new, wk_new, term=term)
        assert got.shape == (n_kv, group, h if term == "delta3" else 2 * h)
        for g in range(n_kv):
            for j in range(group):
                ref = dense_increment_sv(wq[g, j], wk[g, 0], wq_new[g, j], wk_new[g, 0], term)[: got.shape[-1]]
                assert relative_errors(got[g, j], ref, d)[0] <= 1e-4
        explicit = qk_increment_singular_values(wq, wk.expand_as(wq), wq_new, wk_new.expand_as(wq_new), term=term)
        assert torch.allclose(explicit, got, rtol=1e-6, atol=0)


def test_gram_core_megatron_views_and_short_blocks():
    gen = torch.Generator().manual_seed(26)
    heads, h, d = 3, 4, 48
    weights = [torch.randn(heads * h, d, generator=gen) for _ in range(2)]
    steps = [w + 1e-3 * torch.randn(w.shape, generator=gen) for w in weights]
    views = [w.view(heads, h, d).mT for w in (weights[0], weights[1], steps[0], steps[1])]
    got = qk_increment_singular_values(*views)
    assert torch.allclose(got, qk_increment_singular_values(*[v.contiguous() for v in views]), rtol=1e-6, atol=0)
    for i in range(heads):
        ref = dense_increment_sv(*[v[i] for v in views], "delta2")[: 2 * h]
        assert relative_errors(got[i], ref, d)[0] <= 1e-4
    short = random_blocks(gen, 6, 4, dtype=torch.float32)  # d < 2h
    got = qk_increment_singular_values(*short)
    assert got.shape == (8,) and torch.all(got[6:] == 0)
    assert relative_errors(got[:6], dense_increment_sv(*[b.double() for b in short], "delta2"), 6)[0] <= 1e-4


def test_lowrank_product_gram_matches_qr_and_rejects_unknown_method():
    from mindspeed_proxy.monitor.spectral import lowrank_product_singular_values

    gen = torch.Generator().manual_seed(27)
    a = torch.randn(3, 80, 10, generator=gen)
    b = torch.randn(1, 80, 10, generator=gen)  # shared B: broadcast
    got = lowrank_product_singular_values(a, b)
    for i in range(3):
        ref = np.linalg.svd(a[i].double().numpy() @ b[0].double().numpy().T, compute_uv=False)[:10]
        assert relative_errors(got[i], ref, 80)[0] <= 1e-4
    with pytest.raises(ValueError):
        lowrank_product_singular_values(a, b, method="svd")


def test_gram_core_congruence_by_sygst_equals_the_two_gemms_in_float64():
    # issue 35: FᵀG_BF by LAPACK sygst (m³ flops, lower triangle) instead of two GEMMs (4m³), same values
    from mindspeed_proxy.monitor.spectral import _congruence, _gram_core_singular_values, _psd_factor_checked, uses_sygst

    pytest.importorskip("scipy.linalg.lapack")
    gen = torch.Generator().manual_seed(35)
    d, m = 96, 20
    a = torch.randn(3, 1, d, m, generator=gen, dtype=torch.float64) * torch.logspace(0, -3, m, dtype=torch.float64)
    b = torch.randn(1, 4, d, m, generator=gen, dtype=torch.float64)  # GQA-like broadcast of the key side
    f, lower = _psd_factor_checked(a.mT @ a, torch.finfo(torch.float64).eps)
    assert lower and uses_sygst(f) and not uses_sygst(f.float())
    core, uplo = _congruence(f, b.mT @ b, lower)
    ref = f.mT @ (b.mT @ b) @ f
    assert uplo == "L" and core.shape == (3, 4, m, m)
    assert (core.tril() - ref.tril()).abs().max() <= 1e-13 * ref.abs().max()
    got = _gram_core_singular_values(a.mT @ a, b.mT @ b, torch.finfo(torch.float64).eps)
    dense = np.linalg.svd((a @ b.mT).numpy(), compute_uv=False)[..., :m]  # σ(A·Bᵀ) of the formed d×d products
    assert np.abs(got.numpy() - dense).max() <= 1e-12 * dense.max()
    # a rank-deficient query Gram: Cholesky fails, F comes from eigh (not triangular) and takes the GEMM path
    a[0, 0, :, 1] = a[0, 0, :, 0]
    f, lower = _psd_factor_checked(a.mT @ a, torch.finfo(torch.float64).eps)
    assert not lower and _congruence(f, b.mT @ b, lower)[1] == "U"
    got = _gram_core_singular_values(a.mT @ a, b.mT @ b, torch.finfo(torch.float64).eps)
    dense = np.linalg.svd((a @ b.mT).numpy(), compute_uv=False)[..., :m]
    assert np.abs(got.numpy() - dense).max() <= 1e-10 * dense.max()


@pytest.mark.parametrize("long_side", [16384, 262144])
@pytest.mark.parametrize("mode", [None, "row"])
def test_update_stats_of_a_tall_low_rank_update_equal_the_float64_reference(long_side, mode):
    """A float32 ΔW of exact rank 3 (σ = 3, 2, 0.3) with a 64×64 Gram of `long_side`-long dot products: the
    monitor's update statistics equal the float64 reference of its 3 nonzero σ. The Gram's null-space σ stay below
    the √(64·eps) floor; a floor from the dot-product length (√(262144·eps) = 0.18) would drop σ = 0.3 of 3."""
    from mindspeed_proxy.monitor.config import STAT_NAMES
    from mindspeed_proxy.monitor.spectral_family import update_stats

    gen = torch.Generator().manual_seed(11)
    u = torch.linalg.qr(torch.randn(long_side, 3, generator=gen, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(64, 3, generator=gen, dtype=torch.float64))[0]
    delta = (u @ torch.diag(torch.tensor([3.0, 2.0, 0.3], dtype=torch.float64)) @ v.T).float()  # [long, 64]
    if mode == "row":
        delta = delta.T.contiguous()  # [64, long]: the out×out Gram
    gram = update_gram(delta, mode)
    assert gram.shape == (64, 64)
    got = update_stats(gram)
    ref = spectral_stats(torch.linalg.svdvals(delta.double()), rank=3)
    for i, name in enumerate(STAT_NAMES):
        assert got[i].item() == pytest.approx(ref[name].item(), rel=2e-4), name
