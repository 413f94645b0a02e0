"""Router monitor math against float64 numpy/scipy references and direct double loops."""
import math

import numpy as np
import pytest
import torch
from scipy.special import entr, softmax

from mindspeed_proxy.monitor.router import RouterStats, router_weight_stats, winner_persistence


def cosine_double_loop(w):
    e = w.shape[0]
    total = 0.0
    for i in range(e):
        for j in range(e):
            if i != j:
                ni, nj = np.linalg.norm(w[i]), np.linalg.norm(w[j])
                total += 0.0 if ni == 0 or nj == 0 else float(w[i] @ w[j]) / (ni * nj)
    return total / (e * (e - 1))


def conditioning_direct(w):
    mean = w.mean(axis=0)
    return max(np.linalg.norm(row - mean) for row in w) / np.linalg.norm(mean)


def test_router_weight_stats_match_direct_formulas():
    rng = np.random.default_rng(0)
    weights = rng.normal(size=(3, 8, 16)) + 0.4  # shared offset so S and ε are far from trivial
    weights[2, 5] = 0.0  # a zero row: cosine 0 with everything
    got = router_weight_stats(torch.from_numpy(weights))
    for b in range(3):
        assert got["similarity"][b].item() == pytest.approx(cosine_double_loop(weights[b]), rel=1e-10)
        assert got["conditioning_ratio"][b].item() == pytest.approx(conditioning_direct(weights[b]), rel=1e-10)
        norms = np.linalg.norm(weights[b], axis=1)
        assert got["row_norm_mean"][b].item() == pytest.approx(norms.mean(), rel=1e-10)
        assert got["row_norm_max"][b].item() == pytest.approx(norms.max(), rel=1e-10)
    u = weights[0] / np.linalg.norm(weights[0], axis=1, keepdims=True)
    e = u.shape[0]
    assert got["similarity"][0].item() == pytest.approx((e * np.sum(u.mean(0) ** 2) - 1) / (e - 1), rel=1e-10)


def test_router_weight_stats_low_precision_computed_in_fp32():
    rng = np.random.default_rng(1)
    weights = rng.normal(size=(64, 256)) + 0.1
    bf16 = torch.from_numpy(weights).to(torch.bfloat16)
    got = router_weight_stats(bf16)
    assert got["similarity"].dtype == torch.float32
    exact = bf16.double().numpy()
    assert got["similarity"].item() == pytest.approx(cosine_double_loop(exact), rel=1e-3)
    assert got["conditioning_ratio"].item() == pytest.approx(conditioning_direct(exact), rel=1e-3)


def test_router_weight_stats_degenerate_cases():
    same = torch.ones(4, 3).mul(torch.tensor([[1.0, 2.0, 3.0]]))
    stats = router_weight_stats(same)
    assert stats["similarity"].item() == pytest.approx(1.0, abs=1e-6)
    assert stats["conditioning_ratio"].item() == 0.0
    opposite = torch.tensor([[1.0, 2.0], [-1.0, -2.0]])
    stats = router_weight_stats(opposite)
    assert stats["similarity"].item() == pytest.approx(-1.0, abs=1e-6)
    assert stats["conditioning_ratio"].item() == math.inf
    assert router_weight_stats(torch.zeros(4, 3))["conditioning_ratio"].item() == 0.0
    assert router_weight_stats(torch.randn(1, 3))["similarity"].item() == 1.0


def reference_routing(logits, k):
    """float64 numpy: mean entropy, load from top-k, mean margin."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1, logits.shape[-1])
    entropy = entr(softmax(x, axis=-1)).sum(-1)
    order = np.argsort(-x, axis=-1, kind="stable")
    sorted_x = np.take_along_axis(x, order, axis=-1)
    margin = sorted_x[:, k - 1] - sorted_x[:, k] if k < x.shape[1] else np.zeros(len(x))
    load = np.bincount(order[:, :k].reshape(-1), minlength=x.shape[1])
    return entropy, load, margin


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_router_stats_entropy_load_margin(dtype):
    gen = torch.Generator().manual_seed(2)
    num_experts, k, tokens = 8, 2, 203
    logits = (3.0 * torch.randn(tokens, num_experts, generator=gen, dtype=torch.float64)).to(dtype)
    stats = RouterStats(num_layers=3, num_experts=num_experts, topk=k, chunk_size=16)
    stats.update(1, logits)
    summary = stats.summary()
    entropy, load, margin = reference_routing(logits.double().numpy(), k)
    tol = 1e-5 if dtype == torch.float64 else 1e-3
    assert summary["tokens"].tolist() == [0, tokens, 0]
    assert summary["entropy"][1].item() == pytest.approx(entropy.mean(), rel=tol)
    assert summary["normalized_entropy"][1].item() == pytest.approx(entropy.mean() / math.log(8), rel=tol)
    assert summary["margin"][1].item() == pytest.approx(margin.mean(), rel=tol)
    assert summary["load"][1].tolist() == load.tolist()
    assert summary["load"][1].sum().item() == k * tokens


def test_router_stats_chunking_and_shapes_do_not_matter():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 25, 6, generator=gen)  # [seq, batch, E] like Megatron's router input
    small = RouterStats(1, 6, 2, chunk_size=7)
    big = RouterStats(1, 6, 2, chunk_size=10_000)
    small.update(0, logits)
    big.update(0, logits.reshape(-1, 6))
    assert torch.allclose(small.as_tensor(), big.as_tensor(), rtol=1e-6, atol=0)
    assert small.as_tensor().dtype == torch.float32 and small.as_tensor().numel() == 1 * (3 + 6)


def test_router_stats_explicit_indices_and_routing_map():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(50, 8, generator=gen)
    indices = torch.randint(0, 8, (50, 2), generator=gen)  # e.g. routing with expert bias
    routing_map = torch.zeros(50, 8, dtype=torch.bool).scatter(1, indices, True)
    by_index = RouterStats(1, 8, 2)
    by_index.update(0, logits, indices)
    assert by_index.load()[0].tolist() == np.bincount(indices.reshape(-1).numpy(), minlength=8).tolist()
    by_map = RouterStats(1, 8, 2)
    by_map.update(0, logits, routing_map)
    assert by_map.load()[0].tolist() == routing_map.sum(0).float().tolist()
    for routing in (indices, routing_map):  # the load is counted once, however many chunks the tokens take
        chunked, whole = RouterStats(1, 8, 2, chunk_size=7), RouterStats(1, 8, 2)
        chunked.update(0, logits, routing)
        whole.update(0, logits, routing)
        expected = by_index.load()[0] if routing is indices else by_map.load()[0]
        assert chunked.load()[0].tolist() == whole.load()[0].tolist() == expected.tolist()
        assert torch.allclose(chunked.as_tensor(), whole.as_tensor(), rtol=1e-6, atol=0)
    with pytest.raises(IndexError):
        by_map.update(1, logits)
    with pytest.raises(ValueError):
        by_map.update(0, logits[:, :4])


@pytest.mark.parametrize("num_experts", [8, 32])  # the margin from a running top-(k+1) (E <= 16) or torch.topk
@pytest.mark.parametrize("pending_bytes", [1, 3000, 1 << 30])
def test_router_stats_batched_calls_equal_per_layer_float64_sums(pending_bytes, num_experts):
    """Calls held and folded in together (layers interleaved; derived top-k, explicit ids and routing maps
    mixed; a call larger than the limit folded at once) give each layer the float64 sums of its own calls."""
    gen = torch.Generator().manual_seed(5)
    num_layers, k = 3, 2
    stats = RouterStats(num_layers, num_experts, k, chunk_size=16, pending_bytes=pending_bytes)
    want = {layer: {"tokens": 0, "entropy": 0.0, "margin": 0.0, "load": np.zeros(num_experts)}
            for layer in range(num_layers)}
    for call in range(9):
        layer, tokens = call % num_layers, 7 + 13 * call
        logits = 2.5 * torch.randn(tokens, num_experts, generator=gen)
        kind = call % 3 if call != 4 else 0
        routing = None
        if kind:
            ids = torch.randint(0, num_experts, (tokens, k), generator=gen)
            routing = ids if kind == 1 else torch.zeros(tokens, num_experts, dtype=torch.bool).scatter(1, ids, True)
        stats.update(layer, logits, routing)
        entropy, load, margin = reference_routing(logits.double().numpy(), k)
        if routing is not None:
            load = np.bincount(ids.reshape(-1).numpy(), minlength=num_experts) if kind == 1 \
                else routing.sum(0).numpy()
        w = want[layer]
        w["tokens"] += tokens
        w["entropy"] += entropy.sum()
        w["margin"] += margin.sum()
        w["load"] = w["load"] + load
    summary = stats.summary()
    for layer, w in want.items():
        assert summary["tokens"][layer].item() == w["tokens"]
        assert summary["entropy"][layer].item() == pytest.approx(w["entropy"] / w["tokens"], rel=1e-5)
        assert summary["margin"][layer].item() == pytest.approx(w["margin"] / w["tokens"], rel=1e-5)
        assert summary["load"][layer].tolist() == w["load"].tolist()
    stats.update(0, torch.randn(5, num_experts, generator=gen))
    stats.reset()  # a held call is dropped with the sums
    assert stats.as_tensor().abs().sum().item() == 0.0


def test_router_stats_margin_with_tied_logits_and_a_given_routing_map():
    """Ties among the top-(k+1) logits (a margin of 0 for many tokens): the margin equals the sorted reference."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randint(-2, 3, (300, 6), generator=gen).float()
    routing_map = torch.zeros(300, 6, dtype=torch.bool).scatter(1, torch.topk(logits, 3).indices, True)
    stats = RouterStats(1, 6, 3)
    stats.update(0, logits, routing_map)
    _, _, margin = reference_routing(logits.double().numpy(), 3)
    assert (margin == 0).sum() > 50
    assert stats.summary()["margin"][0].item() == pytest.approx(margin.mean(), rel=1e-6)


def test_router_stats_summary_load_metrics():
    stats = RouterStats(num_layers=2, num_experts=4, topk=1)
    # layer 0: experts get 6, 2, 0, 0 tokens
    logits = torch.full((8, 4), -5.0)
    logits[:6, 0] = 5.0
    logits[6:, 1] = 5.0
    stats.update(0, logits)
    summary = stats.summary(ep_size=2)
    q = np.array([6, 2, 0, 0]) / 8
    assert summary["load_entropy"][0].item() == pytest.approx(entr(q).sum(), rel=1e-6)
    assert summary["normalized_load_entropy"][0].item() == pytest.approx(entr(q).sum() / math.log(4), rel=1e-6)
    assert summary["max_over_mean"][0].item() == pytest.approx(6 / 2, rel=1e-6)
    assert summary["dead_experts"][0].item() == 2
    assert summary["overload"][0].item() == pytest.approx(8 / 4, rel=1e-6)  # EP ranks hold {0,1} and {2,3}
    assert stats.summary(ep_size=4)["overload"][0].item() == pytest.approx(6 / 2, rel=1e-6)
    assert summary["margin"][0].item() == pytest.approx(10.0, rel=1e-6)
    for key, value in summary.items():  # layer 1 saw nothing: all zero, no NaN
        assert torch.all(value[1] == 0), key
    with pytest.raises(ValueError):
        stats.summary(ep_size=3)
    stats.reset()
    assert torch.count_nonzero(stats.as_tensor()) == 0


def test_router_stats_masked_and_nonfinite_logits():
    stats = RouterStats(2, 4, 1)
    masked = torch.tensor([[0.0, 0.0, -math.inf, -math.inf]])
    stats.update(0, masked)
    assert stats.summary()["entropy"][0].item() == pytest.approx(math.log(2), rel=1e-6)
    stats.update(1, torch.tensor([[0.0, math.nan, 1.0, 2.0]]))
    assert math.isnan(stats.summary()["entropy"][1].item())  # NaN must reach the detector, not vanish


def test_router_stats_topk_equal_to_experts_has_zero_margin():
    stats = RouterStats(1, 4, 4)
    stats.update(0, torch.randn(10, 4))
    assert stats.summary()["margin"][0].item() == 0.0
    assert stats.load()[0].tolist() == [10.0] * 4


def test_winner_persistence():
    prev = torch.tensor([[10.0, 9.0, 1.0, 0.0], [1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]])
    cur = torch.tensor([[9.0, 1.0, 10.0, 0.0], [4.0, 3.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    assert winner_persistence(prev, cur, top=2).tolist() == [0.5, 0.0, 0.0]
    assert winner_persistence(prev, prev, top=2).tolist() == [1.0, 1.0, 1.0]
    assert winner_persistence(prev, cur).tolist() == [0.0, 0.0, 0.0]  # n = 1: the single winner
    stats = RouterStats(3, 4, 2)
    stats.load().copy_(cur)
    assert stats.winner_persistence(prev).tolist() == [0.5, 0.0, 0.0]
    with pytest.raises(ValueError):
        winner_persistence(prev, cur, top=5)


def test_monitors_never_build_autograd_graphs():
    logits = torch.randn(12, 4, requires_grad=True)
    stats = RouterStats(1, 4, 2)
    stats.update(0, logits * 2)
    assert stats.as_tensor().grad_fn is None and not stats.as_tensor().requires_grad
    weight = torch.nn.Parameter(torch.randn(4, 8))
    assert all(not v.requires_grad for v in router_weight_stats(weight).values())
