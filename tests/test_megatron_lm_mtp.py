"""Megatron-LM's own `pretrain_gpt.py` with multi-token prediction (`--mtp-num-layers 1`, DeepSeek-V3's MTP block)
through the converter and back, as a user runs it: train (8 experts, EP=2; DeepSeek-V3's sigmoid router with expert
bias and a shared expert), convert with the plain command to K=4 at EP=1, load the proxy with the source's flags
plus exactly the printed ones and train 2 steps (the MTP loss logged). Legacy at PP=2 (the MTP block on the last
stage) and torch_dist. Needs MEGATRON_LM_PATH (tests/test_megatron_lm.py); skips with the reason otherwise.
"""
from __future__ import annotations

import json
import math
import re

import pytest

from test_megatron_lm import MLM, MODEL_FLAGS, _losses, env, mlm  # noqa: F401  (fixtures)
from test_megatron_lm_convert import COMMON, _ok, convert, pretrain

pytestmark = pytest.mark.skipif(
    not MLM,
    reason="MEGATRON_LM_PATH is not set: these tests need a Megatron-LM checkout (core_v0.16 line), "
           "which CI does not have",
)

DEEPSEEK = ["--mtp-num-layers", "1", "--moe-shared-expert-intermediate-size", "64", "--moe-router-score-function",
            "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-load-balancing-type", "none"]
CASES = {  # name: (format, source ranks, flags)
    "legacy_pp2": ("torch", 4, ["--pipeline-model-parallel-size", "2"]),
    "dist": ("torch_dist", 2, []),
}
MTP_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?mtp_1 loss: ([0-9.E+-]+)")


@pytest.mark.parametrize("case", sorted(CASES))
def test_mtp_checkpoint_converts_and_loads_back_with_printed_flags(mlm, env, tmp_path, case):
    fmt, world, flags = CASES[case]
    model = MODEL_FLAGS + COMMON + DEEPSEEK + flags + ["--ckpt-format", fmt]
    src, out = tmp_path / "source", tmp_path / "proxy"
    _ok(pretrain(mlm, env, tmp_path, world, model + ["--train-iters", "3", "--save", str(src), "--save-interval", "3"]))
    launch, accelerators, stdout = convert(env, tmp_path, src, out, 1, 4)
    assert re.search(r"^  mtp\.0: keep \[", stdout, re.M), stdout
    manifest = json.loads((out / "proxy_manifest.json").read_text())
    mtp = [layer for layer in manifest["layers"] if layer["layer"] == "mtp.0"]
    assert len(mtp) == 1 and mtp[0]["prefix"] == "mtp.layers.0.transformer_layer.mlp."
    assert mtp[0]["pipeline_stage"] == (1 if "--pipeline-model-parallel-size" in flags else 0)
    assert len(mtp[0]["kept_global_ids_in_new_order"]) == 4
    res = pretrain(mlm, env, tmp_path, accelerators, model + ["--train-iters", "2"] + launch)
    text = _ok(res)
    losses, mtp_losses = _losses(text), dict(MTP_LOSS.findall(text))
    assert sorted(losses) == [1, 2] and all(math.isfinite(float(v)) for v in losses.values()), losses
    assert sorted(mtp_losses) == ["1", "2"] and all(math.isfinite(float(v)) for v in mtp_losses.values()), text[-2000:]
    assert f"successfully loaded checkpoint from {out}" in text
