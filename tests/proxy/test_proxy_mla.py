"""MLA MoE end to end: the trainer (--multi-latent-attention, EP=2, 2 ranks) writes the MLA attention-spectral
family with the monitor on, and the converter turns its legacy checkpoint into a proxy that loads bit-exact."""
import json
import math
import os
import shutil

import pytest
import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.testing import run_distributed
from mindspeed_proxy.training.loop import train

from test_proxy_legacy import _convert, _rank_file, identity_check  # noqa: E402  (tests/proxy is on sys.path)

MLA = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "24", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm"]


@pytest.fixture(scope="module")
def mla_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    flags = ["--num-layers", "2", "--train-iters", "3", "--lr-warmup-iters", "1", "--global-batch-size", "8",
             "--micro-batch-size", "2", "--expert-model-parallel-size", "2", "--ckpt-format", "torch",
             "--save", str(root / "ckpt"), "--log-dir", str(root / "logs"), "--enable-mechanism-monitor",
             "--mechanism-monitor-interval", "1", "--mechanism-monitor-delta", "1"] + MLA
    run_distributed(train, 2, flags, timeout=300)
    return root


def test_mla_training_writes_the_mla_attention_spectral_family(mla_run):
    records = [json.loads(line) for line in open(mla_run / "logs" / "mechanism_monitor" / "monitor.jsonl")]
    assert not [r for r in records if r["type"] == "monitor-error"]
    samples = [r for r in records if r["type"] == "sample" and r["family"] == "attention-spectral"]
    assert [r["step"] for r in samples] == [1, 2, 3]
    for r in samples:
        assert sorted(r["layers"]) == ["0", "1"]
        for layer in r["layers"].values():
            assert sorted(layer) == ["delta2", "rope_delta2"]  # content ("nope") form and the RoPE form
            for term in layer.values():
                assert sorted(term["heads"]) == ["0", "1", "2", "3"]
                assert all(v is not None and math.isfinite(v) for v in term["mean"].values())
                if r["step"] > 1:  # step 1 runs at lr 0 (warm-up): no increment
                    assert term["mean"]["frobenius"] > 0 and term["mean"]["effective_rank"] > 1
    update = [r for r in records if r["type"] == "sample" and r["family"] == "update-spectral"]
    assert all("linear_proj" in layer for r in update for layer in r["layers"].values())


def test_mla_checkpoint_converts_and_loads_bit_exact(mla_run, tmp_path):
    src, out = str(tmp_path / "ckpt"), str(tmp_path / "proxy")
    # the reference loader below reads the first entry of iter_*/ as a rank folder: leave the monitor state out
    shutil.copytree(mla_run / "ckpt", src, ignore=shutil.ignore_patterns("mechanism_monitor_state.json"))
    kept, manifest = _convert(src, out, 1, 4, "random")
    assert sorted(kept) == [0, 1] and all(len(v) == 4 for v in kept.values())
    keys = safe_torch_load(_rank_file(out, 0, 0, 1))["model"]
    mla_keys = [k for k in keys if ".self_attention.linear_" in k and "proj" in k]
    assert {k.split(".")[-2] for k in mla_keys} == {"linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                                                   "linear_kv_up_proj", "linear_proj"}
    results = run_distributed(identity_check, 2, src, out, 1, 2, 1, 4, kept, timeout=300)
    for r in results:
        assert r["masked"] <= 1e-6 * max(1.0, r["scale"]), r
        assert r["unmasked"] > 1e-3, r
        assert r["checked"]["experts"] == 2 * 4 * 2 and r["checked"]["router"] == 2
        assert r["checked"]["other"] > 10
    assert isinstance(keys["decoder.layers.0.self_attention.kv_layernorm.weight"], torch.Tensor)
    assert os.path.isfile(os.path.join(out, "proxy_manifest.json")) and manifest["layers"]


def test_trainer_refuses_mla_above_tp1():
    """megatron-core's local MLA drops other TP ranks' heads from the RoPE key gradient (docs/monitor.md)."""
    from mindspeed_proxy.training.arguments import ArgumentError, build_parser, validate_static

    validate_static(build_parser().parse_args(MLA))
    with pytest.raises(ArgumentError, match="RoPE key"):
        validate_static(build_parser().parse_args(MLA + ["--tensor-model-parallel-size", "2"]))
