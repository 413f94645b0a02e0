"""torch_dist checkpoints from the real trainer -> proxy -> loaded by megatron-core (strict) at EP2 with K experts."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mindspeed_proxy.testing import run_distributed, run_python
from mindspeed_proxy.training.loop import train

from helpers import common_files, dist_common, model_flags, forward as _forward, load_model, mask_router as _mask_router  # noqa: E402,E501
from test_proxy_legacy import _first_losses  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ITER = "iter_0000002"
EXPERTS, ROUTER = "decoder.layers.mlp.experts.", "decoder.layers.mlp.router."


def read_all(folder):
    """Every model tensor of a torch_dist folder, read with plain torch.distributed.checkpoint (no megatron)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(folder).read_metadata()
    state = {k: torch.zeros(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata) and not k.startswith("optimizer.")}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    return state


def _convert(src, out, ep_dst, k, selection, seed=3, extra=(), fresh=False):
    """Run convert_to_proxy.py in its own process (dist_checkpointing's writer spawns; keeps pytest clean): forked
    from the launcher's fork server (run_python), or with `fresh` a new interpreter, whose stderr also holds
    whatever the imports print."""
    argv = [str(REPO / "convert_to_proxy.py"), "--load", src, "--save", out, "--target-expert-parallel-size",
            str(ep_dst), "--target-num-experts", str(k), "--selection", selection, "--seed", str(seed), *extra]
    if fresh:
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300)
    return run_python(argv, timeout=300)


def _kept(out):
    manifest = json.load(open(os.path.join(out, "proxy_manifest.json")))
    return {e["layer"]: e["kept_global_ids_in_new_order"] for e in manifest["layers"]}, manifest


def identity_check(src, out, args, tp, ep_src, ep_dst, k, kept):
    """On each rank: proxy forward vs masked original forward; proxy's non-expert params vs the original's.

    `args` comes from the caller: safe_torch_load here would un-register megatron's Namespace allowlisting
    (torch's safe_globals context removes its entries on exit) and break load_common_state_dict."""
    from mindspeed_proxy.testing.batches import synthetic_microbatches
    from mindspeed_proxy.training.arguments import model_config

    cfg = model_config(args)
    batch = synthetic_microbatches([[0, 1]], cfg.seq_length, cfg.vocab_size)[0]
    original = load_model(src, cfg, tp, ep_src, "torch_dist")[0]
    plain = _forward(original, batch)
    reference = {n: v.clone() for n, v in original.state_dict().items() if isinstance(v, torch.Tensor)}
    _mask_router(original, kept)
    masked = _forward(original, batch)
    proxy = load_model(out, cfg.replace(num_experts=k), tp, ep_dst, "torch_dist")[0]
    got = _forward(proxy, batch)
    checked = {"router": 0, "other": 0}
    for key, value in proxy.state_dict().items():
        if not isinstance(value, torch.Tensor) or ".experts." in key.replace("shared_experts", ""):
            continue
        layer = int(key.split(".")[2]) if key.startswith("decoder.layers.") else None
        if ".router." in key:
            assert torch.equal(value, reference[key][kept[layer]]), key
            checked["router"] += 1
        else:
            assert torch.equal(value, reference[key]), key
            checked["other"] += 1
    return {"masked": (got - masked).abs().max().item(), "unmasked": (got - plain).abs().max().item(),
            "scale": masked.abs().max().item(), "checked": checked}


CASES = [  # (checkpoint, tp, ep_src, ep_dst, k, selection)
    ("ep2_bias", 1, 2, 1, 4, "random"),
    ("ep2_bias", 1, 2, 2, 4, "cluster"),
    ("tp2", 2, 1, 2, 4, "random"),
]


@pytest.mark.parametrize("name,tp,ep_src,ep_dst,k,selection", CASES)
def test_dist_proxy_bit_exact_and_matches_masked_original(dist_checkpoints, hash_folder, tmp_path, name, tp,
                                                          ep_src, ep_dst, k, selection):
    src = dist_checkpoints(name)
    before = hash_folder(src)
    out = str(tmp_path / "proxy")
    run = _convert(src, out, ep_dst, k, selection)
    assert run.returncode == 0, run.stderr
    assert "verified: " in run.stdout
    assert f"--expert-model-parallel-size {ep_dst} --num-experts {k} --ckpt-format torch_dist --load {out} " \
        "--dist-ckpt-strictness raise_all" in run.stdout, run.stdout
    kept, manifest = _kept(out)
    assert manifest["format"] == "torch_dist" and sorted(kept) == [0, 1]
    assert all(len(v) == k and v == sorted(v) for v in kept.values())
    if selection == "random":
        assert any(max(v) >= k for v in kept.values()), kept
    names = sorted(os.listdir(os.path.join(out, ITER)))  # one process writes: __0_<i>.distcp file(s)
    assert [n for n in names if not n.startswith("__0_")] == common_files()
    distcp = [n for n in names if n.startswith("__0_")]
    assert distcp and all(n.endswith(".distcp") and n[4:-7].isdigit() for n in distcp), names
    assert hash_folder(src) == before  # the source is never written
    common = dist_common(os.path.join(out, ITER))
    assert "optimizer" not in common and common["iteration"] == 2
    a = common["args"]
    assert (a.num_experts, a.expert_model_parallel_size, a.world_size, a.data_parallel_size) == (
        k, ep_dst, tp * ep_dst, ep_dst)
    # (a) bit-exact against the source, both read with plain torch.distributed.checkpoint
    source, proxy = read_all(os.path.join(src, ITER)), read_all(os.path.join(out, ITER))
    assert set(proxy) == {key for key in source if not key.startswith("optimizer.")}
    experts = 0
    for key, value in source.items():
        if key.startswith((EXPERTS, ROUTER)):
            for layer, ids in kept.items():
                assert torch.equal(proxy[key][layer], value[layer][ids]), key
                experts += k
        else:
            assert proxy[key].dtype == value.dtype and torch.equal(proxy[key], value), key
    assert experts == 2 * k * (2 + (2 if "bias" in name else 1))  # fc1, fc2, router weight (+ expert_bias)
    # (b) functional identity through megatron's strict sharded load at EP2
    args = dist_common(os.path.join(src, ITER))["args"]
    results = run_distributed(identity_check, tp * max(ep_src, ep_dst), src, out, args, tp, ep_src, ep_dst, k,
                              kept, timeout=300)
    for r in results:
        assert r["masked"] <= 1e-6 * max(1.0, r["scale"]), r  # observed: exactly 0.0
        assert r["unmasked"] > 1e-3, r
        assert r["checked"]["router"] == 2 * (2 if "bias" in name else 1) and r["checked"]["other"] > 10


def test_dist_proxy_trains_from_converted_checkpoint(dist_checkpoints, tmp_path):
    src = dist_checkpoints("ep2_bias")
    out = str(tmp_path / "proxy")
    assert _convert(src, out, 1, 4, "cluster").returncode == 0
    flags = model_flags("ep2_bias") + ["--finetune", "--no-load-optim", "--no-load-rng", "--ckpt-format",
                                       "torch_dist", "--train-iters", "3", "--num-experts", "4", "--load", out,
                                       "--log-dir", str(tmp_path / "logs")]
    run_distributed(train, 1, flags, timeout=300)
    losses = _first_losses(tmp_path / "logs")
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    source_losses = _first_losses(src + "-logs")
    assert abs(losses[0] - source_losses[-1]) < 1.0, (losses, source_losses)  # starts near the trained source


@pytest.mark.parametrize("case", ["truncated-distcp", "missing-metadata"])
def test_dist_bad_input(dist_checkpoints, hash_folder, tmp_path, case):
    root = str(tmp_path / "ckpt")
    shutil.copytree(dist_checkpoints("ep2_bias"), root)
    folder = os.path.join(root, ITER)
    if case == "truncated-distcp":
        path = os.path.join(folder, "__1_0.distcp")
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
        fragment = "truncated or unreadable shard"
    else:
        os.remove(os.path.join(folder, ".metadata"))
        fragment = "missing .metadata"
    before = hash_folder(root)
    run = _convert(root, str(tmp_path / "out"), 1, 4, "cluster", fresh=True)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith("convert_to_proxy.py: error: ") and fragment in lines[0], lines[0]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no OUT_DIR, no temporary folder
    assert hash_folder(root) == before
