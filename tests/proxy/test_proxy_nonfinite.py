"""NaN / Inf in the source (a checkpoint saved after a divergence): named in one line and refused by default,
nothing written; --non-finite-experts keep / exclude build the proxy anyway and record it in the manifest.
Which experts are non-finite is checked independently, in float64, from the raw files."""
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.proxy.cli import main
from mindspeed_proxy.testing import run_python

REPO = Path(__file__).resolve().parents[2]
ITER = "iter_0000002"
LOCAL = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.")
# (file, layer, local expert, tensor, value): global id = EP rank x 4 local experts + local
PLANTS = [("mp_rank_00_001", 1, 1, "linear_fc1.weight", float("nan")),
          ("mp_rank_00_000", 0, 2, "linear_fc2.weight", float("inf"))]


def _path(root, name):
    return os.path.join(root, ITER, name, "model_optim_rng.pt")


def _plant(root, plants=PLANTS):
    for name, layer, local, tensor, value in plants:
        state = safe_torch_load(_path(root, name))
        state["model"][f"decoder.layers.{layer}.mlp.experts.local_experts.{local}.{tensor}"][0, 3] = value
        torch.save(state, _path(root, name))


def non_finite_experts(root):
    """{(layer, global id)} whose expert tensors hold NaN/Inf, read in float64 from every file (independent
    of the converter: its own key parsing, its own id arithmetic)."""
    bad = set()
    for ep in range(2):
        model = safe_torch_load(_path(root, f"mp_rank_00_{ep:03d}"))["model"]
        for key, value in model.items():
            match = LOCAL.match(key)
            if match and isinstance(value, torch.Tensor) and not torch.isfinite(value.to(torch.float64)).all():
                bad.add((int(match.group(1)), ep * 4 + int(match.group(2))))
    return bad


@pytest.fixture
def planted(checkpoints, tmp_path):
    root = str(tmp_path / "ckpt")
    shutil.copytree(checkpoints("ep2_bias"), root)
    _plant(root)
    return root


def _run(root, out, *extra, k=4):
    return main(["--load", root, "--save", str(out), "--target-expert-parallel-size", "1",
                 "--target-num-experts", str(k), *extra])


def test_refused_by_default_naming_tensors_and_experts(planted, tmp_path, capsys, hash_folder):
    before = hash_folder(planted)
    assert non_finite_experts(planted) == {(1, 5), (0, 2)}
    assert _run(planted, tmp_path / "out") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("convert_to_proxy.py: error: non-finite expert weights"), err
    assert "layer 0: experts [2]; layer 1: experts [5]" in err[0]
    assert f"linear_fc1.weight of local expert 1 in {_path(planted, 'mp_rank_00_001')}: 1 NaN, 0 Inf" in err[0]
    assert "linear_fc2.weight of local expert 2" in err[0] and "0 NaN, 1 Inf" in err[0]
    assert "--non-finite-experts keep" in err[0]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"] and hash_folder(planted) == before


@pytest.mark.parametrize("selection", ["cluster", "random"])
def test_exclude_never_selects_them(planted, tmp_path, selection):
    out = tmp_path / "out"
    assert _run(planted, out, "--non-finite-experts", "exclude", "--selection", selection) == 0
    bad = non_finite_experts(planted)
    manifest = json.loads((out / "proxy_manifest.json").read_text())
    record = manifest["non_finite_experts"]
    assert record["mode"] == "exclude"
    assert {(e["layer"], e["expert"]) for e in record["experts"]} == bad
    assert not any(e["kept_in_proxy"] for e in record["experts"])
    for layer in manifest["layers"]:
        excluded = {g for (l, g) in bad if l == layer["layer"]}
        assert layer["excluded_from_selection"] == sorted(excluded)
        assert not excluded & set(layer["kept_global_ids_in_new_order"])
        assert len(layer["kept_global_ids_in_new_order"]) == 4
        assert all(layer["cluster_labels"][g] == -1 for g in excluded)
    model = safe_torch_load(str(out / ITER / "mp_rank_00" / "model_optim_rng.pt"))["model"]
    assert all(torch.isfinite(v.to(torch.float64)).all() for k, v in model.items() if isinstance(v, torch.Tensor))


def test_keep_copies_them_bit_exact(planted, tmp_path):
    """K = E keeps every expert: the planted NaN and Inf are in the proxy where they were."""
    out = tmp_path / "out"
    assert _run(planted, out, "--non-finite-experts", "keep", k=8) == 0
    record = json.loads((out / "proxy_manifest.json").read_text())["non_finite_experts"]
    assert record["mode"] == "keep" and all(e["kept_in_proxy"] for e in record["experts"])
    assert {(e["layer"], e["expert"]) for e in record["experts"]} == non_finite_experts(planted)
    model = safe_torch_load(str(out / ITER / "mp_rank_00" / "model_optim_rng.pt"))["model"]
    assert torch.isnan(model["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"][0, 3])
    assert torch.isinf(model["decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight"][0, 3])


def test_non_expert_tensor_refused_even_with_keep(checkpoints, tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    shutil.copytree(checkpoints("ep2_bias"), root)
    state = safe_torch_load(_path(root, "mp_rank_00_000"))
    key = "decoder.layers.0.self_attention.linear_proj.weight"
    state["model"][key][1, 1] = float("nan")
    torch.save(state, _path(root, "mp_rank_00_000"))
    assert _run(root, tmp_path / "out", "--non-finite-experts", "keep") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and f"non-finite values in model.{key} in {_path(root, 'mp_rank_00_000')}: 1 NaN" in err[0]
    assert not (tmp_path / "out").exists()


def test_torch_dist_nan_expert_named(dist_checkpoints, tmp_path):
    """A flipped float inside a .distcp expert chunk: refused naming layer and expert; exclude avoids it."""
    from mindspeed_proxy.proxy.io import pages
    from mindspeed_proxy.proxy.io.dist.chunks import ChunkReader

    root = tmp_path / "ckpt"
    shutil.copytree(dist_checkpoints("ep2_bias"), root)
    folder = str(root / ITER)
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    reader = ChunkReader(folder)
    layer, expert = 1, 6
    offsets, sizes = next((o, s) for o, s in reader.chunks(key)
                          if o[0] <= layer < o[0] + s[0] and o[1] <= expert < o[1] + s[1])
    chunk = reader.read(key, offsets)
    element = chunk[layer - offsets[0], expert - offsets[1]].reshape(-1)[:1]
    path, where = pages.file_ranges([element])[0]
    reader.forget()
    with open(path, "r+b") as fh:  # one float32 of the stored bytes becomes NaN
        fh.seek(where)
        fh.write(torch.tensor([float("nan")], dtype=element.dtype).numpy().tobytes())
    # the command forked from the launcher's fork server (torch and megatron-core imported: ~3 CPU-s less a run);
    # its exit code and one stderr line from a new interpreter: tests/proxy/test_proxy_bad_input.py
    base = [str(REPO / "convert_to_proxy.py"), "--load", str(root), "--target-expert-parallel-size", "1",
            "--target-num-experts", "4"]
    run = run_python(base + ["--save", str(tmp_path / "out")], timeout=300)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert f"layer {layer}: experts [{expert}]" in lines[0] and "linear_fc1.weight[expert 6]" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
    run = run_python(base + ["--save", str(tmp_path / "out"), "--non-finite-experts", "exclude"], timeout=300)
    assert run.returncode == 0, run.stderr
    manifest = json.loads((tmp_path / "out" / "proxy_manifest.json").read_text())
    entry = next(l for l in manifest["layers"] if l["layer"] == layer)
    assert entry["excluded_from_selection"] == [expert] and expert not in entry["kept_global_ids_in_new_order"]
