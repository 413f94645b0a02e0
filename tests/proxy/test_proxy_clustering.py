"""Clustering recovers planted prototypes, from vectors and through a real checkpoint's streamed features."""
import os
import shutil

import numpy as np
import pytest
import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.proxy.select import clustering
from mindspeed_proxy.proxy.io import grams
from mindspeed_proxy.proxy.select import similarity
from mindspeed_proxy.proxy.convert import open_checkpoint
from mindspeed_proxy.proxy.core.options import Options
from mindspeed_proxy.proxy.plan import make_plan


def _planted(n_experts=16, k=4, dim=3000, noise=0.3, seed=0):
    rng = np.random.default_rng(seed)
    protos = rng.standard_normal((k, dim))
    truth = rng.permutation(np.arange(n_experts) % k)
    return protos[truth] + noise * rng.standard_normal((n_experts, dim)), truth


def _same_partition(labels, truth):
    pairs = {(int(a), int(b)) for a, b in zip(labels, truth)}
    return len(pairs) == len(set(truth.tolist())) == len(set(np.asarray(labels).tolist()))


@pytest.mark.parametrize("method", ["agglomerative", "kmeans"])
def test_planted_prototypes_recovered(method):
    vectors, truth = _planted()
    result = clustering.cluster_layer(similarity.similarity_from_vectors(vectors), 4, method, seed=7)
    assert _same_partition(result["labels"], truth)
    assert sorted(truth[result["kept"]].tolist()) == [0, 1, 2, 3]  # one representative per prototype
    assert result["sizes"] == [4, 4, 4, 4]
    assert result["distances"]["max_intra"] < result["distances"]["mean_inter"]


def test_medoid_and_usage_representatives():
    sim = similarity.similarity_from_vectors(np.array([[1.0, 0.0], [0.9, 0.1], [0.8, 0.3], [0.0, 1.0]]))
    dist = clustering.angular_distance(sim)
    labels = np.array([0, 0, 0, 1])
    assert clustering.representatives(labels, dist, "medoid") == [1, 3]  # the middle one of three
    assert clustering.representatives(labels, dist, "usage", usage=np.array([5, 1, 9, 0])) == [2, 3]


def test_medoid_ties_go_to_usage_then_router_norm_not_index():
    """DeepSeek-V3's tiny shape: 4 routing groups of 2 experts and K = 4, so each group is one two-member cluster
    whose medoid is always a tie; the higher id wins wherever its usage (or, without usage, router row) is larger."""
    sim = similarity.similarity_from_vectors(np.random.default_rng(3).standard_normal((8, 16)))
    norms = np.array([1.0, 2.0, 3.0, 1.0, 1.0, 1.0, 0.5, 0.7])  # equal in group 2: lower id
    usage = np.array([5, 4, 0, 9, 3, 3, 1, 1])  # equal in groups 2 and 3: the router norm decides
    assert clustering.cluster_layer(sim, 4, num_groups=4)["kept"] == [0, 2, 4, 6]  # nothing to break ties
    assert clustering.cluster_layer(sim, 4, num_groups=4, router_norms=norms)["kept"] == [1, 2, 4, 7]
    assert clustering.cluster_layer(sim, 4, num_groups=4, usage=usage)["kept"] == [0, 3, 4, 6]
    assert clustering.cluster_layer(sim, 4, num_groups=4, usage=usage, router_norms=norms)["kept"] == [0, 3, 4, 7]


def test_tie_breaks_never_override_a_strict_medoid():
    sim = similarity.similarity_from_vectors(np.array([[1.0, 0.0], [0.9, 0.1], [0.8, 0.3], [0.0, 1.0]]))
    dist = clustering.angular_distance(sim)
    labels = np.array([0, 0, 0, 1])
    loud = np.array([9.0, 0.0, 9.0, 1.0])  # the outer members' usage and router norms lose to the strict medoid
    assert clustering.representatives(labels, dist, "medoid", usage=loud, router_norms=loud) == [1, 3]


def test_group_limited_routing_keeps_k_over_groups_per_group():
    vectors, _ = _planted(n_experts=8, k=4)
    result = clustering.cluster_layer(similarity.similarity_from_vectors(vectors), 4, num_groups=2)
    assert sum(g < 4 for g in result["kept"]) == 2 and sum(g >= 4 for g in result["kept"]) == 2


@pytest.mark.parametrize("seed", range(20))
def test_streamed_gram_equals_dense_gram(seed):
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randn(7, 13, generator=gen).to(torch.bfloat16) for _ in range(5)]
    dense = torch.stack([r.reshape(-1).double() for r in rows])
    expected = (dense @ dense.T).numpy()
    # float32 products summed in float64 (similarity.block_gram): an error of ~1e-7 of |r_i|·|r_j|, not of the
    # entry itself (an off-diagonal entry near 0 from cancellation has no relative accuracy to promise; checking
    # rtol on the entry failed CI once on unseeded rows); bf16 or float16 products would miss this by 1000x
    scale = np.sqrt(np.outer(np.diag(expected), np.diag(expected)))
    error = np.abs(grams.streamed_gram(rows, block_bytes=8 * 5 * 3) - expected)
    assert (error <= 1e-6 * scale).all(), (error / scale).max()


def test_deterministic_for_a_seed():
    vectors, _ = _planted(noise=2.0)  # ambiguous clusters: only the seed makes k-means repeatable
    sim = similarity.similarity_from_vectors(vectors)
    runs = [clustering.cluster_layer(sim, 4, "kmeans", seed=11)["labels"] for _ in range(2)]
    assert runs[0] == runs[1]


def test_planted_experts_in_a_real_checkpoint(checkpoints, tmp_path):
    """Experts of a real EP=4 checkpoint overwritten with noisy copies of 4 prototypes (spread over EP ranks)."""
    root = str(tmp_path / "planted")
    shutil.copytree(checkpoints("ep4"), root)
    truth = np.array([0, 1, 2, 3, 3, 2, 1, 0])  # global expert g -> prototype
    gen = torch.Generator().manual_seed(0)
    protos = {}
    folder = os.path.join(root, "iter_0000002")
    for ep in range(4):
        path = os.path.join(folder, f"mp_rank_00_{ep:03d}", "model_optim_rng.pt")
        state = safe_torch_load(path)
        for key, value in state["model"].items():
            if ".local_experts." in key and key.endswith("weight"):
                local = int(key.split("local_experts.")[1].split(".")[0])
                proto_key = (key.split("local_experts.")[0], key.split(".")[-2], truth[ep * 2 + local])
                if proto_key not in protos:
                    protos[proto_key] = torch.randn(value.shape, generator=gen)
                value.copy_(protos[proto_key] + 0.05 * torch.randn(value.shape, generator=gen))
        torch.save(state, path)
    plan = make_plan(open_checkpoint(root, None), Options(target_ep=2, target_k=4))
    assert len(plan.kept) == 2
    for layer, kept in plan.kept.items():
        assert _same_partition(plan.details[layer]["labels"], truth), plan.details[layer]
        assert sorted(truth[kept].tolist()) == [0, 1, 2, 3]
