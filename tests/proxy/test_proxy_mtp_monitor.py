"""The monitor on a model with a multi-token prediction block (DeepSeek-V3's MTP, `--mtp-num-layers 1`): every
family covers the MTP layer and names it `mtp.0` (megatron numbers its transformer layer num_layers + 1, which
must not read as a decoder layer), its router statistics are those of the MTP router, and its expert-feature
files feed the converter under the same names."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.proxy.cli import main


@pytest.fixture(scope="module")
def run(checkpoints):
    """The shared `mtp` checkpoint (helpers.CONFIGS): trained 2 steps with the monitor on at every step."""
    root = Path(checkpoints("mtp"))
    return {"ckpt": root, "monitor": root.parent / "mtp-logs" / "mechanism_monitor"}


def _samples(run, family):
    records = [json.loads(line) for line in open(run["monitor"] / "monitor.jsonl")]
    return [r for r in records if r["type"] == "sample" and r["family"] == family]


def test_every_family_names_the_mtp_layer(run):
    for family in ("router", "update-spectral", "attention-spectral"):
        samples = _samples(run, family)
        assert samples and all(list(s["layers"]) == ["0", "1", "mtp.0"] for s in samples), (family, samples[-1])
    update = _samples(run, "update-spectral")[-1]["layers"]["mtp.0"]
    assert {"router", "linear_qkv", "mlp.fc1", "expert0.fc1"} <= set(update)  # MTP router, attention, shared, experts


def _similarity64(weight):
    u = weight.double() / weight.double().norm(dim=1, keepdim=True)
    e = u.shape[0]
    return ((u.sum(0).norm() ** 2 - e) / (e * (e - 1))).item()  # mean pairwise cosine over i != j


def test_mtp_router_statistics_are_the_mtp_routers(run):
    """The last router sample (after step 2) against a float64 recomputation from the saved step-2 weights."""
    model = safe_torch_load(str(run["ckpt"] / "iter_0000002" / "mp_rank_00_000" / "model_optim_rng.pt"))["model"]
    layers = _samples(run, "router")[-1]["layers"]
    want = {"0": "decoder.layers.0.mlp.", "1": "decoder.layers.1.mlp.", "mtp.0": "mtp.layers.0.transformer_layer.mlp."}
    for name, prefix in want.items():
        ref = _similarity64(model[prefix + "router.weight"])
        assert layers[name]["similarity"] == pytest.approx(ref, rel=1e-4, abs=1e-6), name
    assert abs(layers["mtp.0"]["similarity"] - layers["1"]["similarity"]) > 1e-4  # not decoder layer 1's
    assert sum(layers["mtp.0"]["load"]) > 0


def test_mtp_expert_features_feed_the_converter(run, capsys):
    folder = run["monitor"]
    assert sorted(np.load(folder / "expert_features.npz").files) == ["0", "1", "mtp.0"]
    usage = json.load(open(folder / "expert_usage.json"))
    assert sorted(usage) == ["0", "1", "mtp.0"] and all(sum(c) == 512 * 2 for c in usage.values())  # tokens x top-2
    rc = main(["--load", str(run["ckpt"]), "--dry-run", "--target-expert-parallel-size", "1",
               "--target-num-experts", "4", "--features", str(folder / "expert_features.npz"),
               "--usage-file", str(folder / "expert_usage.json"), "--usage-weighted"])
    out = capsys.readouterr().out
    assert rc == 0 and "  mtp.0: keep " in out, out
