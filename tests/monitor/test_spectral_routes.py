"""The numerical rank of the QK cores follows the noise floor of the route that produced the σ (spectral_routes).

Float32 factors of a known rank r < 2h (the query factor [ΔWq, Wq] built from an r-dim column space, then rounded to
float32, as a latent chain leaves it): the Gram route turns the zero σ into float32 noise of ~1e-4·σ_max, above the
SVD tolerance max(n, d)·eps·σ_max. Counted above the Gram floor √(max(n, d)·eps)·σ_max the rank is r, and the
entropy statistics equal a float64 SVD of the dense d×d Δ2 formed from the same float32 inputs.
"""
from __future__ import annotations

import math

import pytest
import torch

from mindspeed_proxy.monitor.mla_layout import mla_increment_rank_tol, mla_increment_singular_values
from mindspeed_proxy.monitor.spectral import qk_increment_singular_values, qk_increment_spectra, spectral_stats
from mindspeed_proxy.monitor.spectral_routes import gram_rank_tol, lowrank_rank_tol, qk_spectra_rank_tol

EPS32 = torch.finfo(torch.float32).eps
STEP = 1e-2  # ‖ΔW‖ / ‖W‖
# name: (query heads, key heads (1: MLA's shared RoPE key), d, h, known rank r of Δ2 (2h values))
CASES = {"mha": (8, 8, 64, 8, 15), "mla_rope": (8, 1, 64, 8, 15), "mla_rope_short_rows": (8, 1, 48, 8, 14)}


def factors(name: str, seed: int):
    """(Wq_old, Wq_new, Wk_old, Wk_new) float32 [heads, d, h] with rank([ΔWq, Wq]) = r (before float32 rounding)."""
    heads, key_heads, d, h, r = CASES[name]
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(heads, d, r, generator=g, dtype=torch.float64)).Q
    rows = torch.linalg.qr(torch.randn(heads, 2 * h, r, generator=g, dtype=torch.float64)).Q.mT  # orthonormal
    a = basis @ rows * math.sqrt(d)  # [ΔWq / STEP, Wq]: r nonzero σ, all equal
    wk_old = torch.randn(key_heads, d, h, generator=g)
    return a[..., h:].float(), (a[..., h:] + STEP * a[..., :h]).float(), wk_old, wk_old + STEP * torch.randn(
        key_heads, d, h, generator=g)


def monitor_sigma(name: str, wq_old, wq_new, wk_old, wk_new):
    """(σ of Δ2, rank floor) as the monitor's family gets them: MHA's Gram core, or MLA's low-rank core."""
    d, h = wq_old.shape[-2:]
    if name == "mha":
        sigma = qk_increment_spectra(wq_old, wk_old, wq_new, wk_new, ("delta2",))[0]["delta2"]
        return sigma, qk_spectra_rank_tol(d, h, sigma.dtype, "delta2", d)
    blocks = (wq_old, wq_new - wq_old, wk_old, wk_new - wk_old)
    return mla_increment_singular_values(*blocks), mla_increment_rank_tol(*blocks, matrix_dim=d)


def reference(wq_old, wq_new, wk_old, wk_new, r: int) -> dict:
    """Float64 SVD of the dense Δ2 = ΔWq Wkᵀ + Wq ΔWkᵀ from the float32 inputs; entropy (α = 2) of its r largest σ."""
    q0, q1, k0, k1 = (x.double() for x in (wq_old, wq_new, wk_old, wk_new))
    s = torch.linalg.svdvals((q1 - q0) @ k0.mT + q0 @ (k1 - k0).mT)
    p = s[..., :r].square() / s[..., :r].square().sum(-1, keepdim=True)
    entropy = -(p * p.log()).sum(-1)
    return {"sigma": s, "entropy": entropy, "normalized_entropy": entropy / math.log(r)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rank_of_a_rank_deficient_increment_is_counted_above_the_gram_floor(name):
    """Rank r exactly, entropy and normalised entropy equal the float64 SVD's within 1e-5 (measured ≤ 1.3e-7)."""
    r, d, n = CASES[name][4], CASES[name][2], 2 * CASES[name][3]
    floor = math.sqrt(max(n, d) * EPS32)  # written out: the Gram route's floor, relative to σ_max
    svd_counted_noise = 0
    for seed in range(3):
        inputs = factors(name, seed)
        sigma, tol = monitor_sigma(name, *inputs)
        ref = reference(*inputs, r)
        rel = ref["sigma"] / ref["sigma"][..., :1]
        # the fixture: r values far above the floor, the rest far below it in float64
        assert rel[..., r - 1].min() > 30 * floor and rel[..., r].max() < floor / 100, (name, seed)
        assert tol == pytest.approx(floor, rel=1e-12)
        stats = spectral_stats(sigma, matrix_dim=d, rank_tol=tol)
        assert stats["numerical_rank"].tolist() == [r] * sigma.shape[0], (name, seed, stats["numerical_rank"])
        for key in ("entropy", "normalized_entropy"):
            err = ((stats[key].double() - ref[key]).abs() / ref[key]).max()
            assert err <= 1e-5, (name, seed, key, float(err))
        # the SVD tolerance counts the Gram route's float32 noise as rank in some heads (the bug this guards)
        svd_counted_noise += int((spectral_stats(sigma, matrix_dim=d)["numerical_rank"] > r).sum())
    assert svd_counted_noise > 0, name


def test_floor_follows_the_route():
    """The Gram floor on Gram routes only: a direct d×d SVD or a QR core keeps spectral_stats' SVD tolerance."""
    assert gram_rank_tol(16, 64, torch.float32) == pytest.approx(math.sqrt(64 * EPS32))
    assert gram_rank_tol(256, 64, torch.float64) == pytest.approx(math.sqrt(256 * torch.finfo(torch.float64).eps))
    assert qk_spectra_rank_tol(64, 8, torch.float32, "delta3") == pytest.approx(math.sqrt(64 * EPS32))
    assert qk_spectra_rank_tol(64, 8, torch.float32, "delta1", matrix_dim=128) == pytest.approx(
        math.sqrt(128 * EPS32))
    assert qk_spectra_rank_tol(12, 8, torch.float32, "delta2") is None  # d < 2h: the d×d product's SVD
    assert lowrank_rank_tol(64, 16, torch.float32) == pytest.approx(math.sqrt(64 * EPS32))
    assert lowrank_rank_tol(64, 16, torch.float64) is None  # "auto" at float64: QR then SVD
    assert lowrank_rank_tol(64, 16, torch.float32, method="qr") is None
    assert lowrank_rank_tol(8, 16, torch.float32) is None  # d < m: direct SVD


def test_gram_sigma_above_the_qk_floor_are_accurate_at_a_production_width():
    """d = 4096, h = 128, float32 weights, ΔWq / ΔWk with σ log-spaced over 5 decades: every Gram-core σ above
    `qk_spectra_rank_tol` is within 10% of the float64 thin-QR core's, and the entropy counted above the floor is
    within 0.5% of the float64 one (the floor is conservative there, docs/monitor.md: it drops accurate small σ,
    which carry little energy; a floor that let the Gram's noise in would fail the first assertion)."""
    d, h = 4096, 128
    g = torch.Generator().manual_seed(7)

    def low_rank(s):
        u = torch.linalg.qr(torch.randn(d, h, generator=g, dtype=torch.float64)).Q
        v = torch.linalg.qr(torch.randn(h, h, generator=g, dtype=torch.float64)).Q
        return (u * s) @ v.T

    wq, wk = (torch.randn(d, h, generator=g, dtype=torch.float64) / math.sqrt(d) for _ in range(2))
    s = torch.logspace(0, -5, h, dtype=torch.float64) * 1e-3
    blocks = [x.to(torch.float32) for x in (wq, wk, wq + low_rank(s), wk + low_rank(s))]
    got = qk_increment_spectra(*blocks)[0]["delta2"].double()
    ref = qk_increment_singular_values(*(x.double() for x in blocks), method="qr")  # the float64 thin-QR core
    tol = qk_spectra_rank_tol(d, h, torch.float32, "delta2")
    above = ref / ref[0] >= tol
    assert 0 < int(above.sum()) < 2 * h
    assert torch.allclose(got[above], ref[above], rtol=0.1, atol=0)
    entropy = float(spectral_stats(got, rank_tol=tol)["entropy"])
    assert entropy == pytest.approx(float(spectral_stats(ref)["entropy"]), rel=5e-3)
