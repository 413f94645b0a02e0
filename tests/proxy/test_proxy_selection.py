"""Selection options of issue 13: saliency representative, usage-weighted clustering, merge; bad combinations."""
import itertools
import json
import os

import numpy as np
import pytest
import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.proxy.select import clustering
from mindspeed_proxy.proxy.select import similarity
from mindspeed_proxy.proxy.calibrate import forward as outputs
from mindspeed_proxy.proxy.cli import main
from mindspeed_proxy.proxy.convert import open_checkpoint
from mindspeed_proxy.testing import run_distributed

from test_proxy_features import _reference_capture, _tokens  # noqa: E402  (tests/proxy is on sys.path)

BASE = ["--target-expert-parallel-size", "1", "--target-num-experts", "4"]


def test_saliency_representative_is_the_cluster_argmax():
    rng = np.random.default_rng(3)
    sim = similarity.similarity_from_vectors(rng.standard_normal((8, 5)))
    saliency = rng.random(8)
    result = clustering.cluster_layer(sim, 3, representative="saliency", saliency=saliency)
    labels = np.array(result["labels"])
    expected = sorted(int(np.flatnonzero(labels == c)[np.argmax(saliency[labels == c])]) for c in range(3))
    assert result["kept"] == expected
    assert clustering.cluster_layer(sim, 3)["kept"] != expected  # not the medoid here
    assert clustering.cluster_layer(sim, 3, representative="saliency", saliency=1 - saliency)["kept"] != expected


def _weighted_sse(points, labels, weights):
    total = 0.0
    for c in set(labels):
        idx = [i for i, lab in enumerate(labels) if lab == c]
        w, p = weights[idx], points[idx]
        centre = (w[:, None] * p).sum(0) / w.sum()
        total += float((w * ((p - centre) ** 2).sum(1)).sum())
    return total


def _best_partition(points, weights, k):
    best = None
    for labels in itertools.product(range(k), repeat=len(points)):
        if len(set(labels)) == k and labels[0] == 0:
            cost = _weighted_sse(points, labels, weights)
            if best is None or cost < best[0] - 1e-12:
                best = (cost, labels)
    return best[1]


def _partition(labels):
    return {frozenset(i for i, x in enumerate(labels) if x == c) for c in set(labels)}


def test_usage_weighted_kmeans_minimises_the_usage_weighted_objective():
    # unit vectors on a circle: a heavily used pair at 0-10 degrees, rarely used experts spread elsewhere
    angles = np.radians([0, 10, 60, 100, 150, 200, 250, 300])
    vectors = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    usage = np.array([500, 400, 1, 2, 1, 3, 1, 2], dtype=np.float64)
    sim = similarity.similarity_from_vectors(vectors)
    weighted = clustering.cluster_layer(sim, 3, "kmeans", seed=0, usage=usage, usage_weighted=True)
    plain = clustering.cluster_layer(sim, 3, "kmeans", seed=0)
    points = clustering.embedding(sim)
    want = _best_partition(points, clustering.usage_weights(usage), 3)
    assert _partition(weighted["labels"]) == _partition(want)
    assert _partition(plain["labels"]) == _partition(_best_partition(points, np.ones(8), 3))
    assert _partition(weighted["labels"]) != _partition(plain["labels"])  # the weights matter here
    assert weighted["labels"][0] != weighted["labels"][1]  # the two heavy experts are not merged


def test_saliency_equals_float64_reference(checkpoints):
    """REAP-like saliency from the converter's calibration forward vs by hand: mean over routed tokens of
    the normalised sigmoid gate x ||SwiGLU expert output||."""
    src = checkpoints("ep2_bias")
    tokens = _tokens(4)
    captured = run_distributed(_reference_capture, 2, src, "torch", tokens, timeout=300)
    merged = {g: {**captured[0]["experts"][g], **captured[1]["experts"][g]} for g in captured[0]["experts"]}
    ckpt = open_checkpoint(src, None)
    saliency = {}
    outputs.output_features(ckpt, tokens, saliency)
    for g, x in captured[0]["inputs"].items():
        weight, bias = captured[0]["routers"][g]
        scores = torch.sigmoid(x @ weight.T)
        chosen = (scores + bias).topk(2, dim=-1).indices
        gates = scores.gather(1, chosen)
        gates = gates / gates.sum(-1, keepdim=True)
        total, count = np.zeros(8), np.zeros(8)
        for e in range(8):
            w1, w2 = merged[g][e]
            gate, up = (x @ w1.T).chunk(2, dim=-1)
            norm = ((torch.nn.functional.silu(gate) * up) @ w2.T).norm(dim=-1)
            mask = chosen == e
            total[e] = float((gates * mask).sum(-1).mul(norm).sum())
            count[e] = float(mask.sum())
        want = total / np.maximum(count, 1)
        assert np.allclose(saliency[g], want, rtol=1e-5, atol=1e-7 * want.max()), (g, saliency[g], want)
        assert want.max() > 0


def test_merge_is_the_usage_weighted_average(checkpoints, tmp_path, capsys):
    src = checkpoints("ep2_bias")  # sigmoid router with expert_bias, 2 MoE layers, 8 experts at EP=2
    usage = {"0": [0, 10, 0, 0, 30, 0, 20, 5], "1": [9, 8, 7, 6, 5, 4, 3, 100]}
    usage_file = tmp_path / "usage.json"
    usage_file.write_text(json.dumps(usage))
    out = str(tmp_path / "proxy")
    assert main(["--load", src, "--save", out, *BASE, "--representative", "merge",
                 "--usage-file", str(usage_file)]) == 0
    manifest = json.load(open(os.path.join(out, "proxy_manifest.json")))
    assert manifest["representative"] == "merge" and manifest["bit_exact"] is False
    assert "not bit-exact" in manifest["verification"]["experts_are"]
    proxy = safe_torch_load(os.path.join(out, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"))["model"]
    source = {}
    for r in (0, 1):
        source.update({(r, k): v for k, v in safe_torch_load(
            os.path.join(src, "iter_0000002", f"mp_rank_00_00{r}", "model_optim_rng.pt"))["model"].items()})
    for layer in manifest["layers"]:
        g, labels, kept = layer["layer"], np.array(layer["cluster_labels"]), layer["kept_global_ids_in_new_order"]
        counts = np.array(usage[str(g)], dtype=np.float64)
        pre = f"decoder.layers.{g}.mlp."
        for j, rep in enumerate(kept):
            members = np.flatnonzero(labels == labels[rep])
            w = counts[members] / counts[members].sum() if counts[members].sum() else np.full(len(members),
                                                                                                1 / len(members))
            assert counts[rep] == counts[members].max()  # the merge takes the most-used member's slot
            assert layer["merge_weights"][j] == [[int(m), float(x)] for m, x in zip(members, w)]
            for name in ("linear_fc1.weight", "linear_fc2.weight"):
                want = sum(wi * source[(m // 4, f"{pre}experts.local_experts.{m % 4}.{name}")].double()
                           for m, wi in zip(members, w))
                got = proxy[f"{pre}experts.local_experts.{j}.{name}"]
                assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-7), (g, j, name)
            for name in ("weight", "expert_bias"):
                rows = source[(0, pre + "router." + name)].double()
                want = sum(wi * rows[m] for m, wi in zip(members, w))
                assert torch.allclose(proxy[pre + "router." + name][j].double(), want, rtol=1e-6, atol=1e-7)


def _bad_cases(src, dist_src, usage_file):
    return [
        (["--usage-weighted", "--cluster", "agglomerative", "--usage-file", usage_file], "needs --cluster kmeans"),
        (["--usage-weighted"], "--usage-file"),
        (["--usage-weighted", "--selection", "random"], "no meaning with --selection random"),
        (["--representative", "saliency"], "needs --calibration-data"),
        (["--selection", "reconstruction"], "needs --calibration-data"),
        (["--representative", "merge", "--selection", "usage", "--usage-file", usage_file], "no meaning"),
        (["--representative", "merge"], "--usage-file"),
        (["--load", dist_src, "--representative", "merge", "--usage-file", usage_file], "legacy (torch)"),
    ]


def test_bad_selection_combinations(checkpoints, dist_checkpoints, tmp_path, capsys, hash_folder):
    src, dist_src = checkpoints("ep2_bias"), dist_checkpoints("ep2_bias")
    usage_file = tmp_path / "usage.json"
    usage_file.write_text(json.dumps({"0": [1] * 8, "1": [1] * 8}))
    before = hash_folder(src)
    out = str(tmp_path / "proxy")
    for extra, message in _bad_cases(src, dist_src, str(usage_file)):
        load = [] if "--load" in extra else ["--load", src]
        assert main(load + ["--save", out, *BASE] + extra) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("convert_to_proxy.py: error:") and message in err[0], (extra, err)
        assert not os.path.exists(out) and not [n for n in os.listdir(tmp_path) if "proxy-tmp" in n]
    assert hash_folder(src) == before


def _numpy_layer(outputs_, logits, bias, subset, topk, sigmoid):
    """Proxy layer output by hand: top-k of the subset's scores (+bias), softmax over the chosen logits or
    normalised sigmoid gates, weighted sum of the chosen experts' outputs."""
    subset = list(subset)
    lg = logits[:, subset].astype(np.float64)
    score = 1 / (1 + np.exp(-lg)) if sigmoid else lg
    rank = score + (bias[subset] if bias is not None else 0.0)
    out = np.zeros((lg.shape[0], outputs_.shape[2]))
    for t in range(lg.shape[0]):
        top = np.argsort(-rank[t], kind="stable")[:topk]
        gate = score[t, top] / score[t, top].sum() if sigmoid else np.exp(lg[t, top] - lg[t, top].max())
        gate = gate if sigmoid else gate / gate.sum()
        out[t] = (gate[:, None] * outputs_[t, [subset[i] for i in top]]).sum(0)
    return out


@pytest.mark.parametrize("sigmoid", [False, True])
def test_reconstruction_selection_equals_numpy_search(monkeypatch, sigmoid):
    from mindspeed_proxy.proxy.select import reconstruction

    rng = np.random.default_rng(5 + sigmoid)
    t, e, h = 40, 6, 5
    sample = {"outputs": torch.from_numpy(rng.standard_normal((t, e, h)).astype(np.float32)),
              "logits": torch.from_numpy(rng.standard_normal((t, e)).astype(np.float32))}
    bias = rng.standard_normal(e).astype(np.float32) * 0.1 if sigmoid else None
    if sigmoid:
        sample["bias"] = torch.from_numpy(bias)
    routing = {"topk": 2, "use_pre_softmax": False, "score_function": "sigmoid" if sigmoid else "softmax",
               "scaling_factor": None}
    o, lg = sample["outputs"].numpy(), sample["logits"].numpy()
    full = _numpy_layer(o, lg, bias, range(e), 2, sigmoid)

    def err(s):
        return float(((_numpy_layer(o, lg, bias, s, 2, sigmoid) - full) ** 2).sum(-1).mean())
    errors = {s: err(s) for s in itertools.combinations(range(e), 3)}
    want = min(errors, key=errors.get)
    kept, info = reconstruction.select(sample, 3, routing)
    assert tuple(kept) == want and info["search"] == "exhaustive"
    assert np.isclose(info["error"], errors[want], rtol=1e-5)
    monkeypatch.setattr(reconstruction, "EXHAUSTIVE", 1)  # greedy backward elimination, by hand
    greedy = list(range(e))
    while len(greedy) > 3:
        greedy.remove(min(greedy, key=lambda d: err([x for x in greedy if x != d])))
    kept, info = reconstruction.select(sample, 3, routing)
    assert kept == greedy and info["search"] == "greedy"


def test_reconstruction_cli_records_the_search(checkpoints, tmp_path, capsys):
    src = checkpoints("ep2_bias")
    calib = tmp_path / "calib.npy"
    np.save(calib, _tokens(3).numpy())
    out = str(tmp_path / "proxy")
    assert main(["--load", src, "--save", out, *BASE, "--calibration-data", str(calib)]) == 0  # the default
    manifest = json.load(open(os.path.join(out, "proxy_manifest.json")))
    assert manifest["selection"] == "reconstruction" and manifest["bit_exact"] is True
    for layer in manifest["layers"]:
        assert layer["reconstruction"]["search"] == "exhaustive" and layer["reconstruction"]["error"] >= 0
        assert len(layer["kept_global_ids_in_new_order"]) == 4


def test_default_selection_rule():
    from mindspeed_proxy.proxy.cli import build_parser, default_selection

    base = ["--load", "x", *BASE]
    parse = build_parser().parse_args
    assert default_selection(parse(base)) == "cluster"  # data-free: weights, agglomerative, medoid
    assert default_selection(parse(base + ["--calibration-data", "c.npy"])) == "reconstruction"
    for extra in (["--features", "outputs"], ["--representative", "saliency"], ["--cluster", "kmeans"],
                  ["--usage-weighted"], ["--selection", "usage"]):
        assert default_selection(parse(base + ["--calibration-data", "c.npy"] + extra)) != "reconstruction", extra


@pytest.mark.parametrize("keep_all", [True, False])
def test_sequential_reconstruction_sees_the_pruned_inputs(checkpoints, keep_all):
    """Layer 0 is scored on the original inputs; layer 1 on the pruned model's: the same as the original's
    when layer 0 keeps every expert, different when it keeps four."""
    tokens = _tokens(2)
    seen = {}

    def choose(g, sample):
        seen[g] = sample
        return (list(range(8)) if keep_all else [0, 2, 5, 7]), {}
    original, sequential = {}, {"choose": choose}
    ckpt = open_checkpoint(checkpoints("ep2_bias"), None)
    outputs.output_features(ckpt, tokens, None, original, tokens.numel(), sequential)
    assert sorted(sequential["kept"]) == sorted(seen) == [0, 1]
    for name in ("outputs", "logits"):
        assert torch.allclose(seen[0][name], original[0][name], rtol=1e-5, atol=1e-6)
        same = torch.allclose(seen[1][name], original[1][name], rtol=1e-5, atol=1e-6)
        assert same is keep_all, name
