"""Multi-token prediction (DeepSeek-V3's MTP block, `--mtp-num-layers 1`) in the converter, on real checkpoints of
the real trainer: the MTP layer's MoE is pruned with its own selection in both formats and at PP=2 (MTP on the
last stage), recorded as `mtp.0`, verified, and the proxy loads into megatron-core and matches the original with
the dropped experts' routes masked, in the decoder and the MTP layer alike."""
import json
import math
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.proxy.cli import main
from mindspeed_proxy.testing import run_distributed
from mindspeed_proxy.training.loop import train

from helpers import dist_common, load_model, model_flags  # noqa: E402

MTP_PREFIX = "mtp.layers.0.transformer_layer.mlp."


def _convert(src, out, ep, k, *extra):
    rc = main(["--load", src, "--save", out, "--target-expert-parallel-size", str(ep), "--target-num-experts",
               str(k), *extra])
    assert rc == 0
    manifest = json.load(open(os.path.join(out, "proxy_manifest.json")))
    return {e["layer"]: e["kept_global_ids_in_new_order"] for e in manifest["layers"]}, manifest


def _args(src, fmt):
    folder = os.path.join(src, "iter_0000002")
    if fmt == "torch_dist":
        return dist_common(folder)["args"]
    return safe_torch_load(os.path.join(folder, sorted(os.listdir(folder))[0], "model_optim_rng.pt"))["args"]


def _mask(model, kept):
    """Route no token to a dropped expert, in decoder layers (kept[l]) and MTP layers (kept["mtp.i"])."""
    layers = [(l.layer_number - 1, l) for l in model.decoder.layers]
    layers += [(f"mtp.{i}", m.transformer_layer) for i, m in enumerate(model.mtp.layers)]
    for layer_id, layer in layers:
        router = layer.mlp.router
        mask = torch.full((router.weight.shape[0],), -1e9)
        mask[kept[layer_id]] = 0.0
        router.gating = lambda x, gating=router.gating, mask=mask: gating(x) + mask
        with torch.no_grad():
            router.expert_bias[mask < 0] = -1e9


def _run(model, batch):
    """(per-token LM loss, the MTP block's output hidden states) of one forward with labels (megatron-core
    0.16's MTP needs labels)."""
    seen = []
    handle = model.mtp.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    with torch.no_grad():
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).float().clone()
    handle.remove()
    return loss, seen[0]


def masked_check(src, out, fmt, args, k, kept):
    """On each rank: proxy (EP1) vs the original (EP2) with dropped experts masked; the MTP layer's router rows,
    expert bias, shared expert and kept experts against the original's."""
    from mindspeed_proxy.testing.batches import synthetic_microbatches
    from mindspeed_proxy.training.arguments import model_config

    cfg = model_config(args)
    batch = synthetic_microbatches([[0, 1]], cfg.seq_length, cfg.vocab_size)[0]
    original = load_model(src, cfg, 1, 2, fmt)[0]
    plain = _run(original, batch)
    ref = {n: v.clone() for n, v in original.state_dict().items() if isinstance(v, torch.Tensor)}
    ep_rank, n_src = __import__("megatron.core.parallel_state", fromlist=["x"]).get_expert_model_parallel_rank(), 4
    _mask(original, kept)
    masked = _run(original, batch)
    proxy = load_model(out, cfg.replace(num_experts=k), 1, 1, fmt)[0]
    got = _run(proxy, batch)
    checked = {"router": 0, "experts": 0, "other": 0}
    for key, value in proxy.state_dict().items():
        if not isinstance(value, torch.Tensor) or not key.startswith(MTP_PREFIX):
            continue
        if ".router." in key:
            assert torch.equal(value, ref[key][kept["mtp.0"]]), key
            checked["router"] += 1
        elif ".local_experts." in key:
            j = int(key.split(".local_experts.")[1].split(".")[0])
            g = kept["mtp.0"][j]
            if g // n_src == ep_rank:  # this rank holds source expert g
                assert torch.equal(value, ref[key.replace(f"local_experts.{j}.", f"local_experts.{g % n_src}.")]), key
                checked["experts"] += 1
        else:
            assert torch.equal(value, ref[key]), key
            checked["other"] += 1
    diff = lambda a, b: max((a[0] - b[0]).abs().max().item(), (a[1] - b[1]).abs().max().item())  # noqa: E731
    return {"masked": diff(got, masked), "unmasked": diff(got, plain),
            "mtp_unmasked": (got[1] - plain[1]).abs().max().item(), "checked": checked}


def _sizes(folder):
    """{key: (params, bytes)} of every model tensor of a torch_dist iteration folder (optimizer state excluded)."""
    meta = FileSystemReader(folder).read_metadata().state_dict_metadata
    out = {}
    for key, m in meta.items():
        if isinstance(m, TensorStorageMetadata) and not key.startswith(("optimizer.", "rng_state")):
            n = math.prod(m.size)
            out[key] = (n, n * m.properties.dtype.itemsize)
    return out


def check_layer_type_summary(dist_src, out, fmt, manifest, kept, printed):
    """The converter's per-layer-type summary against the checkpoints' own metadata (the torch_dist form of the same
    model for a legacy source): totals, halved routed experts and router rows (E = 8 -> K = 4) in the MoE and MTP
    layers, the rest unchanged."""
    summary = manifest["layer_types"]
    before = _sizes(os.path.join(dist_src, "iter_0000002"))
    total = summary["total"]
    assert [total["params"][0], total["bytes"][0]] == [sum(v[0] for v in before.values()),
                                                       sum(v[1] for v in before.values())]
    assert summary["layers"] == {"dense": [], "moe": [0, 1], "mtp": ["mtp.0"], "other": []}
    parts = {(r["type"], r["part"]): r for r in summary["parts"]}
    halved = 0
    for kind in ("moe", "mtp"):
        for part in ("routed experts", "router weight", "router expert_bias"):
            assert parts[kind, part]["params"][1] * 2 == parts[kind, part]["params"][0] > 0, (kind, part)
            halved += parts[kind, part]["params"][1]
        for part in ("shared expert", "attention, norms"):
            assert parts[kind, part]["params"][0] == parts[kind, part]["params"][1] > 0, (kind, part)
    assert total["params"][1] == total["params"][0] - halved
    if fmt == "torch_dist":
        after = _sizes(os.path.join(out, "iter_0000002"))
        assert [total["params"][1], total["bytes"][1]] == [sum(v[0] for v in after.values()),
                                                           sum(v[1] for v in after.values())]
    router = MTP_PREFIX + "router.weight"
    assert parts["mtp", "router weight"]["params"][0] == before[router][0]
    assert parts["mtp", "MTP eh_proj, enorm, hnorm, final norm"]["params"][0] > 0
    assert parts["other", "embedding, output layer, final norm"]["params"][0] > 0
    for entry in summary["experts"]:
        assert entry["kept"] == kept[entry["layer"]] and sorted(entry["kept"] + entry["dropped"]) == list(range(8))
    assert "per layer type (params, bytes: source -> proxy):" in printed and "mtp.0: routed experts kept" in printed


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_mtp_proxy_matches_masked_original(checkpoints, dist_checkpoints, tmp_path, fmt, capsys):
    src = (checkpoints if fmt == "torch" else dist_checkpoints)("mtp")
    out = str(tmp_path / "proxy")
    kept, manifest = _convert(src, out, 1, 4, "--selection", "random", "--seed", "3")
    assert list(kept) == [0, 1, "mtp.0"] and all(len(v) == 4 for v in kept.values())
    entry = manifest["layers"][2]
    assert entry["prefix"] == MTP_PREFIX and entry["pipeline_stage"] == 0
    assert kept["mtp.0"] != kept[1] or kept["mtp.0"] != kept[0]  # its own selection (random, per-layer draws)
    assert manifest["verification"]["router_rows"] > 0
    check_layer_type_summary(dist_checkpoints("mtp"), out, fmt, manifest, kept, capsys.readouterr().out)
    results = run_distributed(masked_check, 2, src, out, fmt, _args(src, fmt), 4, kept, timeout=300)
    for r in results:
        assert r["masked"] <= 1e-6, r  # observed: 0.0
        assert r["mtp_unmasked"] > 1e-4, r  # the MTP layer's routing matters: its mask is what the proxy reproduces
        assert r["checked"]["router"] == 2 and r["checked"]["other"] == 2, r  # weight + expert_bias; shared fc1, fc2
    assert sum(r["checked"]["experts"] for r in results) == 4 * 2  # 4 kept MTP experts x fc1/fc2, over 2 ranks


def _model_tensors(root, fmt):
    """{key: tensor} of every model tensor of a legacy (per rank file) or torch_dist (global) checkpoint."""
    folder = os.path.join(root, "iter_0000002")
    if fmt == "torch":
        return {(rank, k): v for rank in sorted(os.listdir(folder)) if rank.startswith("mp_rank_")
                for k, v in safe_torch_load(os.path.join(folder, rank, "model_optim_rng.pt"))["model"].items()
                if isinstance(v, torch.Tensor)}
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from mindspeed_proxy.proxy.io.dist.chunks import ChunkReader

    meta, reader = FileSystemReader(folder).read_metadata(), ChunkReader(folder)
    return {k: reader.region(k, (0,) * len(m.size), tuple(m.size)).clone() for k, m in meta.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata) and not k.startswith("optimizer.")}


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_mtp_k_equals_e_is_identity(checkpoints, dist_checkpoints, tmp_path, fmt):
    """K = E at the source's EP keeps every expert in order: every model tensor, the MTP layer's included, is
    bit-identical to the source's."""
    src = (checkpoints if fmt == "torch" else dist_checkpoints)("mtp")
    out = str(tmp_path / "proxy")
    kept, _ = _convert(src, out, 2, 8)
    assert kept == {0: list(range(8)), 1: list(range(8)), "mtp.0": list(range(8))}
    source, proxy = _model_tensors(src, fmt), _model_tensors(out, fmt)
    assert set(source) == set(proxy)
    assert sum(MTP_PREFIX in str(k) for k in source) >= 6
    for key, value in source.items():
        assert proxy[key].dtype == value.dtype and torch.equal(proxy[key], value), key


def test_mtp_pp2_legacy_prunes_last_stage_and_trains(checkpoints, tmp_path):
    """PP=2: the MTP block sits on the last stage's files; a usage file names it `mtp.0`; the proxy trains."""
    src = checkpoints("mtp_pp2")
    usage = tmp_path / "usage.json"
    counts = {"0": [8, 7, 6, 5, 4, 3, 2, 1], "1": [1, 2, 3, 4, 5, 6, 7, 8], "mtp.0": [5, 1, 6, 2, 7, 3, 8, 4]}
    usage.write_text(json.dumps(counts))
    out = str(tmp_path / "proxy")
    kept, manifest = _convert(src, out, 1, 4, "--selection", "usage", "--usage-file", str(usage))
    assert kept == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7], "mtp.0": [0, 2, 4, 6]}
    assert [(e["layer"], e["pipeline_stage"]) for e in manifest["layers"]] == [(0, 0), (1, 1), ("mtp.0", 1)]
    folder = os.path.join(src, "iter_0000002")
    last = safe_torch_load(os.path.join(folder, "mp_rank_00_001", "model_optim_rng.pt"))["model"]
    got = safe_torch_load(os.path.join(out, "iter_0000002", "mp_rank_00_001", "model_optim_rng.pt"))["model"]
    for name in ("router.weight", "router.expert_bias"):
        assert torch.equal(got[MTP_PREFIX + name], last[MTP_PREFIX + name][[0, 2, 4, 6]])
    for j, g in enumerate([0, 2, 4, 6]):
        for fc in ("linear_fc1", "linear_fc2"):
            assert torch.equal(got[f"{MTP_PREFIX}experts.local_experts.{j}.{fc}.weight"],
                               last[f"{MTP_PREFIX}experts.local_experts.{g}.{fc}.weight"])
    assert not any(k.startswith("mtp.") for k in safe_torch_load(
        os.path.join(out, "iter_0000002", "mp_rank_00_000", "model_optim_rng.pt"))["model"])
    flags = model_flags("mtp_pp2") + ["--pipeline-model-parallel-size", "2", "--num-experts", "4", "--ckpt-format",
                                      "torch", "--load", out, "--finetune", "--no-load-optim", "--no-load-rng",
                                      "--log-dir", str(tmp_path / "logs")]
    run_distributed(train, 2, flags, timeout=300)
    losses = [r["loss"] for r in map(json.loads, open(tmp_path / "logs" / "metrics.jsonl")) if r["type"] == "step"]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses), losses


def mtp_reference(src, fmt, args, tokens):
    """On each rank (EP=2): float64 mean over the calibration tokens of every local expert's output on the MTP
    layer's MoE input, computed by hand (SwiGLU) from the loaded weights; {global id: [H]} and the input's size."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps

    from mindspeed_proxy.training.arguments import model_config

    model = load_model(src, model_config(args), 1, 2, fmt)[0]
    seen = []
    mlp = model.mtp.layers[0].transformer_layer.mlp
    handle = mlp.register_forward_pre_hook(lambda m, i: seen.append(i[0].reshape(-1, i[0].shape[-1]).double()))
    with torch.no_grad():
        model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None, labels=torch.roll(tokens, -1, 1))
    handle.remove()
    x = torch.cat(seen)
    n_local, out = len(mlp.experts.local_experts), {}
    for j, expert in enumerate(mlp.experts.local_experts):
        a, b = (x @ expert.linear_fc1.weight.double().T).chunk(2, dim=-1)
        y = (F.silu(a) * b) @ expert.linear_fc2.weight.double().T
        out[ps.get_expert_model_parallel_rank() * n_local + j] = y.mean(dim=0).detach()
    return out, x.shape[0]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_mtp_outputs_features_include_the_mtp_layer(checkpoints, dist_checkpoints, tmp_path, fmt):
    """--features outputs builds the MTP block (labels = the next tokens): the MTP layer's features are the mean
    expert outputs on its own MoE input (float64 reference by hand), its usage counts every routed token, and
    the MTP layer gets its own selection."""
    import numpy as np

    src = (checkpoints if fmt == "torch" else dist_checkpoints)("mtp")
    args = _args(src, fmt)
    calib, feats = tmp_path / "calib.npy", tmp_path / "features.npz"
    tokens = np.random.default_rng(0).integers(0, args.padded_vocab_size, (3, args.seq_length))
    np.save(calib, tokens)
    kept, manifest = _convert(src, str(tmp_path / "proxy"), 1, 4, "--features", "outputs", "--calibration-data",
                              str(calib), "--save-features", str(feats))
    assert list(kept) == [0, 1, "mtp.0"] and manifest["feature_type"] == "outputs"
    usage = {e["layer"]: e["calibration_usage"] for e in manifest["layers"]}
    assert sum(usage["mtp.0"]) == tokens.size * args.moe_router_topk and usage["mtp.0"] != usage[1]
    got = np.load(feats)
    assert set(got.files) == {"0", "1", "mtp.0"} and got["mtp.0"].shape == (8, args.hidden_size)
    results = run_distributed(mtp_reference, 2, src, fmt, args, torch.from_numpy(tokens), timeout=300)
    assert all(n == tokens.size for _, n in results)
    ref = np.stack([results[g // 4][0][g].numpy() for g in range(8)])
    assert np.abs(got["mtp.0"] - ref).max() <= 1e-5 * np.abs(ref).max(), np.abs(got["mtp.0"] - ref).max()
    assert np.abs(got["mtp.0"] - got["1"]).max() > 1e-3  # not the last decoder layer's features again
