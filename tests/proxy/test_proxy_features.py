"""--features outputs (calibration forward), --features FILE, manifest fingerprints, --keep-optimizer-args."""
import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.proxy.calibrate import forward as outputs
from mindspeed_proxy.proxy.cli import main
from mindspeed_proxy.proxy.convert import open_checkpoint
from mindspeed_proxy.proxy.core.options import Options
from mindspeed_proxy.proxy.plan import make_plan
from mindspeed_proxy.testing import run_distributed
from mindspeed_proxy.training.loop import train

from helpers import dist_common, model_flags  # noqa: E402  (tests/proxy is on sys.path under pytest)


BASE = ["--target-expert-parallel-size", "1", "--target-num-experts", "4"]


def _tokens(n=6, seq=64, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, size=(n, seq)))


def _reference_capture(src, fmt, tokens):
    """At the source layout (TP1 EP2), loaded by the trainer's own loader: every MoE layer's input, this
    rank's experts and the routers, in float64."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from mindspeed_proxy.testing import init_parallel
    from mindspeed_proxy.training import checkpointing as C
    from mindspeed_proxy.training.arguments import model_config
    from mindspeed_proxy.training.engine import TrainConfig, Trainer

    init_parallel(tp=1, ep=2)
    folder = C.iteration_dir(src, C.read_tracker(src))
    if fmt == "torch_dist":
        args = dist_checkpointing.load_common_state_dict(folder)["args"]
    else:
        args = safe_torch_load(os.path.join(folder, "mp_rank_00_000", "model_optim_rng.pt"))["args"]
    trainer = Trainer(model_config(args), TrainConfig(micro_batch_size=2, global_batch_size=2 * 2))
    (C.load_dist if fmt == "torch_dist" else C.load_legacy)(src, trainer, load_optim=False, load_rng=False)
    model = trainer.unwrapped()[0].eval()
    inputs, experts, routers = {}, {}, {}
    ep = ps.get_expert_model_parallel_rank()
    for layer in model.decoder.layers:
        g = layer.layer_number - 1
        layer.mlp.register_forward_pre_hook(
            lambda m, a, g=g: inputs.setdefault(g, []).append(a[0].reshape(-1, a[0].shape[-1]).double().clone()))
        local = layer.mlp.experts.local_experts
        experts[g] = {ep * len(local) + i: (e.linear_fc1.weight.detach().double(),
                                            e.linear_fc2.weight.detach().double()) for i, e in enumerate(local)}
        routers[g] = (layer.mlp.router.weight.detach().double(), layer.mlp.router.expert_bias.detach().double())
    with torch.no_grad():
        for start in range(0, len(tokens), 4):
            batch = tokens[start:start + 4]
            model(batch, torch.arange(batch.shape[1]).expand_as(batch), None)
    return {"inputs": {g: torch.cat(x) for g, x in inputs.items()}, "experts": experts, "routers": routers}


def _float64_reference(captured):
    """Mean SwiGLU expert output per expert and sigmoid + expert-bias top-2 counts, by hand in float64."""
    merged = {g: {**captured[0]["experts"][g], **captured[1]["experts"][g]} for g in captured[0]["experts"]}
    vectors, usage = {}, {}
    for g, x in captured[0]["inputs"].items():
        rows = []
        for e in range(8):
            w1, w2 = merged[g][e]
            gate, up = (x @ w1.T).chunk(2, dim=-1)
            rows.append(((torch.nn.functional.silu(gate) * up) @ w2.T).mean(dim=0))
        vectors[g] = torch.stack(rows).numpy()
        weight, bias = captured[0]["routers"][g]
        chosen = (torch.sigmoid(x @ weight.T) + bias).topk(2, dim=-1).indices
        usage[g] = torch.bincount(chosen.reshape(-1), minlength=8).tolist()
    return vectors, usage


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_outputs_features_equal_float64_reference(checkpoints, dist_checkpoints, fmt):
    src = (checkpoints if fmt == "torch" else dist_checkpoints)("ep2_bias")
    tokens = _tokens()
    captured = run_distributed(_reference_capture, 2, src, fmt, tokens, timeout=300)
    assert torch.equal(captured[0]["inputs"][0], captured[1]["inputs"][0])  # same tokens on both ranks
    ref_vectors, ref_usage = _float64_reference(captured)
    ckpt = open_checkpoint(src, None)
    try:
        vectors, usage, count = outputs.output_features(ckpt, tokens)
    finally:
        if hasattr(ckpt, "close"):
            ckpt.close()
    assert count == tokens.numel() == captured[0]["inputs"][0].shape[0]
    assert sorted(vectors) == sorted(ref_vectors) == [0, 1]
    for g in vectors:
        assert vectors[g].shape == (8, 64)
        scale = np.abs(ref_vectors[g]).max()
        # fp32 model vs float64 by hand; observed ~1e-7 relative
        assert np.abs(vectors[g] - ref_vectors[g]).max() <= 1e-5 * scale, g
        assert usage[g] == ref_usage[g] and sum(usage[g]) == 2 * count


def _permuted_copies(src, dst, seed=0):
    """Copy of legacy ep2_bias where global expert 4+p (EP rank 1, local p) computes the same function as
    expert p (EP rank 0): its intermediate neurons permuted (+1e-3 relative noise). Weights look unrelated."""
    shutil.copytree(src, dst)
    folder = os.path.join(dst, "iter_0000002")
    path0, path1 = (os.path.join(folder, f"mp_rank_00_00{r}", "model_optim_rng.pt") for r in (0, 1))
    s0, s1 = safe_torch_load(path0), safe_torch_load(path1)
    gen = torch.Generator().manual_seed(seed)
    for layer in (0, 1):
        for p in range(4):
            pre = f"decoder.layers.{layer}.mlp.experts.local_experts.{p}."
            fc1, fc2 = s0["model"][pre + "linear_fc1.weight"], s0["model"][pre + "linear_fc2.weight"]
            f = fc2.shape[1]
            perm = torch.randperm(f, generator=gen)
            new1 = torch.cat([fc1[:f][perm], fc1[f:][perm]])
            new2 = fc2[:, perm]
            noise = lambda t: t + 1e-3 * t.std() * torch.randn(t.shape, generator=gen)  # noqa: E731
            s1["model"][pre + "linear_fc1.weight"] = noise(new1)
            s1["model"][pre + "linear_fc2.weight"] = noise(new2)
    torch.save(s1, path1)


def _pairs_recovered(labels):
    return all(labels[p] == labels[p + 4] for p in range(4)) and len(set(labels[:4])) == 4


def test_outputs_recover_planted_functional_clusters(checkpoints, tmp_path):
    planted = str(tmp_path / "planted")
    _permuted_copies(checkpoints("ep2_bias"), planted)
    calib = str(tmp_path / "calib.npy")
    np.save(calib, _tokens(4).numpy())
    ckpt = open_checkpoint(planted, None)
    by_outputs = make_plan(ckpt, Options(target_ep=1, target_k=4, features="outputs", calibration_data=calib))
    by_weights = make_plan(ckpt, Options(target_ep=1, target_k=4))
    for layer, d in by_outputs.details.items():
        assert _pairs_recovered(d["labels"]), (layer, d["labels"])
        assert sorted(g % 4 for g in d["kept"]) == [0, 1, 2, 3]
        # the same experts are invisible to the data-free features (their weights are permuted)
        assert not _pairs_recovered(by_weights.details[layer]["labels"]), by_weights.details[layer]["labels"]


def test_features_file_planted_and_round_trip(checkpoints, tmp_path, capsys):
    src = checkpoints("ep2_bias")
    rng = np.random.default_rng(1)
    planted = [2, 0, 1, 3, 3, 1, 0, 2]
    protos = rng.normal(size=(4, 16))
    feats = {str(g): torch.from_numpy(protos[planted] + 0.01 * rng.normal(size=(8, 16))) for g in (0, 1)}
    pt = str(tmp_path / "feats.pt")
    torch.save(feats, pt)
    plan = make_plan(open_checkpoint(src, None), Options(target_ep=1, target_k=4, features=pt))
    for d in plan.details.values():
        groups = {tuple(e for e in range(8) if planted[e] == c) for c in range(4)}
        assert {tuple(e for e in range(8) if d["labels"][e] == c) for c in range(4)} == groups
        assert sorted(planted[g] for g in d["kept"]) == [0, 1, 2, 3]
    # round trip: outputs features written with --save-features, read back as --features FILE
    calib, saved = str(tmp_path / "calib.npy"), str(tmp_path / "saved.npz")
    np.save(calib, _tokens(4).numpy())
    assert main(["--load", src, "--dry-run", *BASE, "--features", "outputs", "--calibration-data", calib,
                 "--save-features", saved]) == 0
    first = capsys.readouterr().out
    assert main(["--load", src, "--dry-run", *BASE, "--features", saved]) == 0
    second = capsys.readouterr().out
    keep = lambda text: [line for line in text.splitlines() if line.strip().startswith("layer ")]  # noqa: E731
    assert keep(first) == keep(second) and len(keep(first)) == 2
    with np.load(saved) as archive:
        assert sorted(archive.files) == ["0", "1"] and archive["0"].shape == (8, 64)


def _run(argv, capsys):
    rc = main(argv)
    return rc, capsys.readouterr().err.strip().splitlines()


def test_bad_features_inputs_refused(checkpoints, tmp_path, capsys, hash_folder):
    src = checkpoints("ep2_bias")
    before = hash_folder(src)
    out = str(tmp_path / "proxy")
    base = ["--load", src, "--save", out, *BASE]
    good = np.random.default_rng(0).normal(size=(8, 4))
    files = {"missing.npz": {"0": good}, "wrong_e.npz": {"0": good, "1": good[:7]},
             "nan.npz": {"0": good, "1": np.where(np.eye(8, 4) > 0, np.nan, good)},
             "extra.npz": {"0": good, "1": good, "5": good}}
    for name, content in files.items():
        np.savez(tmp_path / name, **content)
    torch.save({"0": [1, 2]}, tmp_path / "list.pt")  # a list, not an array
    torch.save(Options(target_ep=1, target_k=4), tmp_path / "object.pt")  # arbitrary object: refused unpickling
    np.save(tmp_path / "big_ids.npy", np.full((2, 8), 10**6))
    np.save(tmp_path / "flat.npy", np.arange(16))
    cases = [
        (["--features", "outputs"], "--features outputs needs --calibration-data"),
        (["--features", "outputs", "--calibration-data", str(tmp_path / "nope.npy")], "no such file"),
        (["--features", "outputs", "--calibration-data", str(tmp_path / "big_ids.npy")], "outside the vocabulary"),
        (["--features", "outputs", "--calibration-data", str(tmp_path / "flat.npy")], "shape [N, S]"),
        (["--features", "outputs", "--calibration-data", str(tmp_path / "nothere")], "indexed dataset prefix"),
        (["--features", "outputs", "--calibration-data", str(tmp_path / "object.pt")], "cannot read"),
        (["--features", "weights", "--calibration-data", str(tmp_path / "flat.npy")],
         "only used with --features outputs"),
        (["--features", str(tmp_path / "missing.npz")], "no features for MoE layer 1"),
        (["--features", str(tmp_path / "wrong_e.npz")], "layer 1 needs a numeric array [8, D], found [7, 4]"),
        (["--features", str(tmp_path / "nan.npz")], "layer 1 holds non-finite values"),
        (["--features", str(tmp_path / "extra.npz")], "key '5' is not a MoE layer"),
        (["--features", str(tmp_path / "list.pt")], "layer 0 needs a numeric array"),
        (["--features", str(tmp_path / "object.pt")], "cannot read"),
        (["--features", str(tmp_path / "absent.npz")], "no such file"),
        (["--features", "output"], "not 'weights' or 'outputs'"),
        (["--save-features", str(tmp_path / "f.npz")], "--save-features needs --features outputs or FILE"),
    ]
    for extra, message in cases:
        rc, err = _run(base + extra, capsys)
        assert rc == 2 and len(err) == 1 and err[0].startswith("convert_to_proxy.py: error: "), (extra, err)
        assert message in err[0], (extra, err)
        assert not os.path.exists(out) and not os.path.exists(tmp_path / "f.npz")
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".proxy.proxy-tmp-")]
    assert hash_folder(src) == before


def test_manifest_records_calibration_and_usage_from_calibration(checkpoints, tmp_path, capsys):
    from mindspeed_proxy.data import default_corpus_prefix

    src = checkpoints("ep2_bias")
    prefix = default_corpus_prefix()
    out = str(tmp_path / "proxy")
    assert main(["--load", src, "--save", out, *BASE, "--features", "outputs", "--calibration-data", prefix,
                 "--calibration-sequences", "3", "--representative", "usage"]) == 0
    manifest = json.load(open(os.path.join(out, "proxy_manifest.json")))
    calib = manifest["inputs"]["calibration_data"]
    assert manifest["selection"] == "cluster" and manifest["feature_type"] == "outputs"
    assert manifest["usage_source"] == "calibration" and manifest["representative"] == "usage"
    assert manifest["calibration_tokens"] == calib["tokens"] == 3 * 64 and calib["format"] == "indexed"
    for ext in ("bin", "idx"):
        digest = hashlib.sha256(open(f"{prefix}.{ext}", "rb").read()).hexdigest()
        assert calib["files_sha256"][os.path.basename(prefix) + "." + ext] == digest
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    docs, i = [], 0
    while sum(map(len, docs)) < 192:
        docs.append(np.asarray(dataset[i], dtype=np.int64))
        i += 1
    ids = np.concatenate(docs)[:192].reshape(3, 64)
    expected = hashlib.sha256(b"[3, 64]" + ids.astype("<i8").tobytes()).hexdigest()
    assert manifest["calibration_fingerprint"] == calib["tokens_sha256"] == expected
    assert manifest["inputs"]["usage_file"] is None and manifest["inputs"]["features_file"] is None
    for layer in manifest["layers"]:  # the kept expert of each cluster is its most-routed member
        counts, labels = layer["calibration_usage"], layer["cluster_labels"]
        assert sum(counts) == 2 * 192
        for c, kept in enumerate(layer["kept_global_ids_in_new_order"]):
            assert counts[kept] == max(counts[e] for e in range(8) if labels[e] == labels[kept])


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_keep_optimizer_args(checkpoints, dist_checkpoints, tmp_path, capsys, fmt):
    src = (checkpoints if fmt == "torch" else dist_checkpoints)("ep2_bias")
    found = {}
    for keep in (False, True):
        out = str(tmp_path / f"proxy-{keep}")
        assert main(["--load", src, "--save", out, *BASE] + (["--keep-optimizer-args"] if keep else [])) == 0
        flags = [l for l in capsys.readouterr().out.splitlines() if l.startswith("launch flags:")][0]
        assert ("--finetune" in flags) is not keep and "--no-load-optim --no-load-rng" in flags
        if fmt == "torch":
            state = safe_torch_load(os.path.join(out, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"))
        else:
            state = dist_common(os.path.join(out, "iter_0000002"))
        found[keep] = state
        assert ("opt_param_scheduler" in state) is keep and state["iteration"] == 2
        assert "optimizer" not in state and "rng_state" not in state
        manifest = json.load(open(os.path.join(out, "proxy_manifest.json")))
        assert manifest["keep_optimizer_args"] is keep
        assert ("opt_param_scheduler" in manifest["dropped"]) is not keep
    assert found[True]["opt_param_scheduler"]["num_steps"] == 2 * 8  # the source's schedule position
    if fmt == "torch":  # the printed flags resume the trainer at the source's iteration (2), not at 0
        log = str(tmp_path / "logs")
        run_distributed(train, 1, model_flags("ep2_bias") + [
            "--ckpt-format", "torch", "--num-experts", "4", "--load", str(tmp_path / "proxy-True"),
            "--no-load-optim", "--no-load-rng", "--train-iters", "3", "--log-dir", log], timeout=300)
        steps = [json.loads(l) for l in open(os.path.join(log, "metrics.jsonl")) if '"step"' in l]
        assert [s["iteration"] for s in steps] == [3]
        assert steps[0]["lr"] == 0.0  # documented: without the optimizer the LR schedule restarts (warmup)
