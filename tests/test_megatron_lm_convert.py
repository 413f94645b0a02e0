"""Megatron-LM's own checkpoints through the converter and back, as a user runs them.

`pretrain_gpt.py` (core_v0.16 line, unmodified, via `mindspeed_proxy.run` on CPU) trains 8 experts at EP=2
and saves; `convert_to_proxy.py` converts with the plain README command; `pretrain_gpt.py` loads the proxy
with the source's model flags plus exactly the printed launch flags, on the printed number of
accelerators, and trains 2 steps. The K = E identity (a pure reshard to a smaller EP) must give the
original's first-step loss on the same batch. Needs MEGATRON_LM_PATH (see tests/test_megatron_lm.py and
docs/megatron_lm.md); skips with the reason otherwise.
"""
from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from test_megatron_lm import MLM, MODEL_FLAGS, _losses, env, mlm  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(
    not MLM,
    reason="MEGATRON_LM_PATH is not set: these tests need a Megatron-LM checkout (core_v0.16 line), "
           "which CI does not have",
)

REPO = Path(__file__).resolve().parents[1]
SOURCE_STEPS = 3
# 8 experts at EP=2; no dropout, so that a run at another DP / EP layout sees the same computation
COMMON = ["--num-experts", "8", "--hidden-dropout", "0", "--attention-dropout", "0"]
# Each case combines features, to keep the number of Megatron-LM runs (tens of seconds each) small.
CASES = {
    # legacy files, PP=2 x EP=2 on 4 ranks; MoE only in layers 1-3 (--moe-layer-freq); LayerNorm
    "legacy_pp2": dict(fmt="torch", world=4, flags=[
        "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--moe-layer-freq", "[0,1,1,1]",
        "--normalization", "LayerNorm"]),
    # torch_dist, EP=2 on 2 ranks; legacy GroupedMLP (bf16), a shared expert, sigmoid router + expert bias
    "dist_grouped": dict(fmt="torch_dist", world=2, flags=[
        "--moe-grouped-gemm", "--bf16", "--moe-shared-expert-intermediate-size", "64",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-load-balancing-type", "none"]),
    # torch_dist, TP=2 (sequence parallel, as Megatron-LM requires with MoE) x EP=2 on 4 ranks; the proxy keeps TP=2
    "dist_tp2": dict(fmt="torch_dist", world=4, flags=[
        "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
}
LAYOUT = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--expert-model-parallel-size",
          "--num-experts", "--ckpt-format", "--load")


def _layout(case: str, flag: str) -> int:
    flags = CASES[case]["flags"]
    return int(flags[flags.index(flag) + 1]) if flag in flags else 1


def model_flags(case: str) -> list:
    """The source's flags (model and training), without --save / --load."""
    return MODEL_FLAGS + COMMON + CASES[case]["flags"] + ["--ckpt-format", CASES[case]["fmt"]]


def pretrain(mlm: Path, env: dict, cwd: Path, nproc: int, argv: list) -> subprocess.CompletedProcess:
    """Megatron-LM's pretrain_gpt.py through the launcher on `nproc` gloo ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--standalone", "-m", "mindspeed_proxy.run", str(mlm / "pretrain_gpt.py"), *argv]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)


def _ok(res: subprocess.CompletedProcess) -> str:
    out = res.stdout + res.stderr
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return out


def convert(env: dict, cwd: Path, src: Path, out: Path, ep: int, k: int, *extra: str) -> tuple:
    """The README's plain command; returns (printed launch flags as argv, accelerators, stdout)."""
    res = subprocess.run([sys.executable, str(REPO / "convert_to_proxy.py"), "--load", str(src), "--save", str(out),
                          "--target-expert-parallel-size", str(ep), "--target-num-experts", str(k), *extra],
                         env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    flags = [line[len("launch flags: "):] for line in res.stdout.splitlines() if line.startswith("launch flags: ")]
    world = re.search(r"^accelerators: \d+ -> (\d+) ", res.stdout, re.M)
    assert len(flags) == 1 and world, res.stdout
    return shlex.split(flags[0]), int(world.group(1)), res.stdout


@pytest.fixture(scope="module")
def sources(mlm, env, tmp_path_factory):
    """sources(case) -> a checkpoint that pretrain_gpt.py trained for SOURCE_STEPS and saved (built once)."""
    built: dict = {}

    def build(case: str):
        if case not in built:
            cwd = tmp_path_factory.mktemp(case)
            save = cwd / "source"
            res = pretrain(mlm, env, cwd, CASES[case]["world"], model_flags(case) + [
                "--train-iters", str(SOURCE_STEPS), "--save", str(save), "--save-interval", str(SOURCE_STEPS)])
            _ok(res)
            assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(SOURCE_STEPS)
            built[case] = (save, cwd)
        return built[case]
    return build


def calibration_tokens(path: Path) -> str:
    """16 sequences of seq-length 64 token ids below the vocabulary size (256), as a .npy file."""
    np.save(path, np.random.default_rng(0).integers(0, 256, size=(16, 64), dtype=np.int64))
    return str(path)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("features", ["weights", "outputs"])
def test_proxy_loads_back_with_printed_flags(mlm, env, sources, case, features):
    """K=4 at EP=1 (--features weights or outputs): Megatron-LM loads the proxy with the source's flags plus
    exactly the printed ones (strict for torch_dist) and trains 2 steps with finite losses."""
    src, cwd = sources(case)
    out = cwd / f"proxy-k4-{features}"
    extra = [] if features == "weights" else [
        "--features", "outputs", "--calibration-data", calibration_tokens(cwd / "calib.npy")]
    flags, world, stdout = convert(env, cwd, src, out, 1, 4, *extra)
    for flag in LAYOUT:
        assert flag in flags, (flag, flags)
    tp, pp = _layout(case, "--tensor-model-parallel-size"), _layout(case, "--pipeline-model-parallel-size")
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == str(tp)
    assert flags[flags.index("--pipeline-model-parallel-size") + 1] == str(pp)
    assert flags[flags.index("--num-experts") + 1] == "4"
    assert ("--dist-ckpt-strictness" in flags) is (CASES[case]["fmt"] == "torch_dist")
    assert world == tp * pp  # TP x PP x EP=1
    manifest = json.loads((out / "proxy_manifest.json").read_text())
    assert all(len(layer["kept_global_ids_in_new_order"]) == 4 for layer in manifest["layers"])
    res = pretrain(mlm, env, cwd, world, model_flags(case) + ["--train-iters", "2"] + flags)
    losses = _losses(_ok(res))
    assert sorted(losses) == [1, 2] and all(math.isfinite(float(v)) for v in losses.values()), losses
    assert f"successfully loaded checkpoint from {out}" in res.stdout + res.stderr


@pytest.mark.parametrize("case", sorted(CASES))
def test_k_equals_e_is_a_pure_reshard(mlm, env, sources, case):
    """K = E at EP=1 keeps every expert in order: the proxy's first-step loss equals the original's on the
    same batch (torch_dist: the original loaded at the proxy's EP; legacy: at its own EP, as legacy
    files do not reshard: the same numbers up to reduction order)."""
    src, cwd = sources(case)
    fmt = CASES[case]["fmt"]
    flags, world, _ = convert(env, cwd, src, cwd / "proxy-k8", 1, 8)
    proxy = pretrain(mlm, env, cwd, world, model_flags(case) + ["--train-iters", "2"] + flags)
    assert f"successfully loaded checkpoint from {cwd / 'proxy-k8'}" in _ok(proxy)
    proxy = _losses(proxy.stdout + proxy.stderr)
    start = ["--load", str(src), "--finetune", "--no-load-optim", "--no-load-rng", "--train-iters", "2"]
    if fmt == "torch_dist":  # default strictness: the original also holds optimizer state, not loaded here
        original = pretrain(mlm, env, cwd, world, model_flags(case) + start + ["--expert-model-parallel-size", "1"])
    else:
        original = pretrain(mlm, env, cwd, CASES[case]["world"], model_flags(case) + start)
    original = _losses(_ok(original))
    assert 1 in proxy and 1 in original, (proxy, original)
    print(f"{case}: first-step loss proxy {proxy[1]} original {original[1]}")
    if fmt == "torch_dist":
        assert proxy[1] == original[1], (proxy, original)
    else:
        assert math.isclose(float(proxy[1]), float(original[1]), rel_tol=2e-6), (proxy, original)
