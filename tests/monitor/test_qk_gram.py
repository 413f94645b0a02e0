"""QK Gram blocks (qk_gram) and `qk_increment_spectra`: every term, reused Grams over many samples, vs float64 dense SVD."""
import pytest
import torch

from mindspeed_proxy.monitor.qk_gram import factor_blocks, rows_gram, term_grams
from mindspeed_proxy.monitor.spectral import qk_increment_singular_values, qk_increment_spectra

TERMS = ("delta1", "delta2", "delta3")


def dense_term(wq_old, wk_old, wq_new, wk_new, term):
    """The formed d×d increment in float64."""
    wq_old, wk_old, wq_new, wk_new = (x.double() for x in (wq_old, wk_old, wq_new, wk_new))
    dq, dk = wq_new - wq_old, wk_new - wk_old
    return {"delta1": wq_new @ wk_new.mT - wq_old @ wk_old.mT,
            "delta2": dq @ wk_old.mT + wq_old @ dk.mT,
            "delta3": dq @ dk.mT}[term]


def relative_error(got, wq_old, wk_old, wq_new, wk_new, term):
    """max |σ_i − σ_ref,i| / σ_ref,i over reference values above the fp32 rank tolerance, all heads."""
    ref = torch.linalg.svdvals(dense_term(wq_old, wk_old, wq_new, wk_new, term))[..., :got.shape[-1]]
    tol = max(got.shape[-1], wq_old.shape[-2]) * torch.finfo(torch.float32).eps
    keep = ref > tol * ref[..., :1]
    err = (got.double() - ref).abs() / ref.clamp_min(1e-300)
    return err[keep].max().item(), ref


def test_factor_blocks_and_syrk_match_float64():
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(3, 200, 8, generator=gen)
    new = old + 1e-3 * torch.randn(3, 200, 8, generator=gen)
    blocks = factor_blocks(old, new)
    o, dlt = old.double(), (new - old).double()
    for got, want in ((blocks.delta, dlt.mT @ dlt), (blocks.cross, o.mT @ dlt), (blocks.old, o.mT @ o),
                      (blocks.new_gram(), new.double().mT @ new.double())):
        assert got.dtype == torch.float64
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    rows = torch.randn(2, 8, 300, generator=gen)
    assert torch.allclose(rows_gram(rows), rows @ rows.mT, rtol=1e-5, atol=1e-4)
    reused = factor_blocks(old, new, old_gram=blocks.old)
    assert torch.equal(reused.old, blocks.old) and torch.equal(reused.cross, blocks.cross)
    a, b = term_grams(blocks, blocks, "delta2")  # [ΔW, W] and [W, ΔW]: the same Gram up to a block swap
    assert torch.allclose(a.roll((8, 8), (-2, -1)), b, rtol=0, atol=0)


def test_spectra_of_all_terms_at_once_equal_single_terms_and_dense():
    gen = torch.Generator().manual_seed(1)
    d, h = 256, 16
    wq, wk = 0.02 * torch.randn(2, 4, d, h, generator=gen), 0.02 * torch.randn(2, 1, d, h, generator=gen)  # GQA
    wq_new = wq + 2e-5 * torch.randn(wq.shape, generator=gen)
    wk_new = wk + 2e-5 * torch.randn(wk.shape, generator=gen)
    sigmas, (gq, gk) = qk_increment_spectra(wq, wk, wq_new, wk_new, TERMS)
    assert gq.shape == (2, 4, h, h) and gk.shape == (2, 1, h, h)  # at each factor's own shape
    for term in TERMS:
        assert torch.equal(sigmas[term], qk_increment_singular_values(wq, wk, wq_new, wk_new, term=term))
        err, _ = relative_error(sigmas[term], wq, wk.expand_as(wq), wq_new, wk_new.expand_as(wq_new), term)
        assert err < 1e-4, (term, err)
    assert sigmas["delta3"].shape[-1] == h and sigmas["delta2"].shape[-1] == 2 * h


def test_reused_grams_stay_exact_over_200_samples():
    """Chained reuse (old Gram from the previous call, never recomputed) against float64 references."""
    gen = torch.Generator().manual_seed(2)
    d, h = 192, 12
    wq, wk = 0.02 * torch.randn(2, 2, d, h, generator=gen), 0.02 * torch.randn(2, 1, d, h, generator=gen)
    grams, worst = None, {t: 0.0 for t in TERMS}
    for step in range(200):
        scale = 2e-5 if step % 50 else 2e-3  # mostly ΔW ~1e-3·W, now and then a large jump
        rank1 = torch.randn(2, 2, d, 1, generator=gen) @ torch.randn(2, 2, 1, h, generator=gen)
        wq_new = wq + scale * torch.randn(wq.shape, generator=gen) + 5 * scale * rank1
        wk_new = wk + scale * torch.randn(wk.shape, generator=gen) if step % 7 else wk.clone()  # keys frozen
        sigmas, grams = qk_increment_spectra(wq, wk, wq_new, wk_new, TERMS, old_grams=grams)
        if step % 10 == 9 or step % 7 == 0:
            for term in TERMS:
                if term == "delta3" and step % 7 == 0:
                    assert torch.count_nonzero(sigmas[term]) == 0  # ΔWk = 0 exactly
                    continue
                err, _ = relative_error(sigmas[term], wq, wk.expand_as(wq), wq_new, wk_new.expand_as(wq_new), term)
                worst[term] = max(worst[term], err)
        wq, wk = wq_new, wk_new
    assert max(worst.values()) < 1e-4, worst
    for got, w in zip(grams, (wq, wk)):  # drift of the chained Gram against the exact one of the last weights
        exact = w.double().mT @ w.double()
        assert ((got - exact).abs().amax() / exact.abs().amax()).item() < 1e-5


def test_reused_grams_zero_update_and_rank_deficient():
    gen = torch.Generator().manual_seed(3)
    d, h = 128, 8
    wq, wk = torch.randn(d, h, generator=gen), torch.randn(d, h, generator=gen)
    _, grams = qk_increment_spectra(wq, wk, wq, wk, TERMS)
    sigmas, grams = qk_increment_spectra(wq, wk, wq, wk, TERMS, old_grams=grams)
    for term in TERMS:
        assert torch.count_nonzero(sigmas[term]) == 0, term
    # rank-1 query update, keys frozen: Δ2 = ΔWq Wkᵀ has exactly one nonzero value
    wq_new = wq + 1e-3 * torch.randn(d, 1, generator=gen) @ torch.randn(1, h, generator=gen)
    sigmas, _ = qk_increment_spectra(wq, wk, wq_new, wk, ("delta2",), old_grams=grams)
    ref = torch.linalg.svdvals(dense_term(wq, wk, wq_new, wk, "delta2"))
    got = sigmas["delta2"].double()
    assert abs(got[0] - ref[0]) / ref[0] < 1e-5
    assert (got[1:] <= max(2 * h, d) * torch.finfo(torch.float32).eps * got[0]).all()  # below the rank tolerance


@pytest.mark.parametrize("d", [10, 20])
def test_small_d_direct_path_returns_grams(d):
    gen = torch.Generator().manual_seed(4)
    h = 8  # d < 2h: the d×d products are solved directly
    wq, wk = torch.randn(d, h, generator=gen), torch.randn(d, h, generator=gen)
    wq_new, wk_new = wq + 0.1 * torch.randn(d, h, generator=gen), wk + 0.1 * torch.randn(d, h, generator=gen)
    sigmas, (gq, gk) = qk_increment_spectra(wq, wk, wq_new, wk_new, TERMS)
    for term in TERMS:
        ref = torch.linalg.svdvals(dense_term(wq, wk, wq_new, wk_new, term))
        m = h if term == "delta3" else 2 * h
        assert sigmas[term].shape[-1] == m
        n = min(d, m)
        assert torch.allclose(sigmas[term][:n].double(), ref[:n], rtol=1e-4, atol=1e-5 * ref[0].item())
        assert torch.count_nonzero(sigmas[term][n:]) == 0
    assert torch.allclose(gq.double(), wq_new.double().mT @ wq_new.double(), rtol=1e-5, atol=1e-5)
