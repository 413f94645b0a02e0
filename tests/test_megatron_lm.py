"""Megatron-LM's own `pretrain_gpt.py`, unmodified, on CPU through `mindspeed_proxy.run`.

Needs a Megatron-LM checkout (core_v0.16 line) named by env MEGATRON_LM_PATH, e.g.
`git archive core_v0.16.1 | tar -x -C /tmp/mlm` and `MEGATRON_LM_PATH=/tmp/mlm`. Megatron-LM's
training-side imports (six, regex, pydantic, triton, ...) must be importable (PYTHONPATH is passed
through), and its dataset helper (megatron/core/datasets/helpers.cpp) is compiled by Megatron-LM at
start, which needs pybind11 and a C++ compiler. CI has no Megatron-LM, so everything here skips
there. See docs/megatron_lm.md.
"""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

MLM = os.environ.get("MEGATRON_LM_PATH", "")

pytestmark = pytest.mark.skipif(
    not MLM,
    reason="MEGATRON_LM_PATH is not set: these tests need a Megatron-LM checkout (core_v0.16 line), "
           "which CI does not have",
)

# Tiny MoE GPT: 2 layers, GQA, RoPE, RMSNorm, SwiGLU, 4 experts top-2, EP=2 over 2 gloo ranks, mock data.
MODEL_FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "20",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
    "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
    "--moe-token-dispatcher-type", "alltoall",
    "--transformer-impl", "local", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "256",
    "--no-gradient-accumulation-fusion", "--no-bias-swiglu-fusion", "--no-masked-softmax-fusion",
    "--no-rope-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
    "--disable-bias-linear", "--normalization", "RMSNorm", "--swiglu",
    "--position-embedding-type", "rope",
    "--distributed-backend", "gloo", "--eval-iters", "0", "--eval-interval", "1000",
    "--log-interval", "1", "--seed", "1234",
]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")


@pytest.fixture(scope="module")
def mlm() -> Path:
    """The checkout, after checking it is one and that its training package imports."""
    root = Path(MLM).resolve()
    if not (root / "pretrain_gpt.py").is_file() or not (root / "megatron" / "training").is_dir():
        pytest.skip(f"MEGATRON_LM_PATH={MLM} is not a Megatron-LM checkout (no pretrain_gpt.py / megatron/training)")
    return root


@pytest.fixture(scope="module")
def env(mlm: Path, tmp_path_factory) -> dict:
    """Environment for the runs: the checkout first on PYTHONPATH, CPU platform, and `python3` /
    `python3-config` shims so Megatron-LM's runtime `make` of its dataset helper builds for this
    interpreter (its Makefile calls whatever `python3` / `python3-config` are on PATH)."""
    shims = tmp_path_factory.mktemp("shims")
    (shims / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    (shims / "python3-config").write_text(
        f'#!/bin/sh\nif [ "$1" = "--extension-suffix" ]; then echo "{suffix}"; exit 0; fi\n'
        'echo "python3-config shim: only --extension-suffix is provided" >&2; exit 1\n')
    for shim in shims.iterdir():
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join([str(mlm)] + [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p])
    out["PATH"] = os.pathsep.join([str(shims), out.get("PATH", "")])
    out["MINDSPEED_PROXY_DEVICE"] = "cpu"
    out["OMP_NUM_THREADS"] = "1"
    out["PYTHONWARNINGS"] = "ignore"

    probe = subprocess.run(
        [sys.executable, "-c", "import megatron.core, megatron.training.training as t; print(megatron.core.__file__)"],
        env=out, cwd=mlm, capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"Megatron-LM at {mlm} does not import here ({last}); install its training "
                    "dependencies (see docs/megatron_lm.md)")
    helper = mlm / "megatron" / "core" / "datasets" / f"helpers_cpp{suffix}"
    if not helper.exists():
        build = subprocess.run(["make", "-C", str(helper.parent)], env=out, capture_output=True, text=True,
                               timeout=300)
        if build.returncode != 0 or not helper.exists():
            pytest.skip(f"cannot build Megatron-LM's dataset helper {helper.name} (needs pybind11 and a C++ "
                        f"compiler): {build.stderr.strip()[-300:]}")
    return out


def _launch(mlm: Path, env: dict, cwd: Path, *extra: str, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--standalone",
           "-m", "mindspeed_proxy.run", str(mlm / "pretrain_gpt.py"), *MODEL_FLAGS, *extra]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


def _losses(output: str) -> dict[int, str]:
    return {int(i): loss for i, loss in LOSS.findall(output)}


def _single(mlm: Path, env: dict, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mindspeed_proxy.run", str(mlm / "pretrain_gpt.py"), *argv],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_help_lists_monitor_flags(mlm, env, tmp_path):
    """Megatron-LM's own parser, through the patched parse_args, lists our flags under --help."""
    res = _single(mlm, env, tmp_path, "--help")
    if res.returncode and "unsupported format character" in res.stderr and "_expand_help" in res.stderr:
        pytest.skip("Megatron-LM's own --help fails on this checkout (core_v0.19.0: an unescaped % in the help "
                    "of --moe-paged-stash-buffer-size-factor-cuda)")
    assert res.returncode == 0, res.stderr[-3000:]
    for flag in ("--enable-mechanism-monitor", "--mechanism-monitor-config", "--mechanism-monitor-interval",
                 "--mechanism-monitor-delta", "--mechanism-monitor-output", "--inject-fault"):
        assert flag in res.stdout
    assert "--expert-model-parallel-size" in res.stdout  # still Megatron-LM's parser


def test_unknown_flag_still_errors(mlm, env, tmp_path):
    """An unknown flag is an argparse error, exit 2, as in Megatron-LM without us."""
    res = _single(mlm, env, tmp_path, "--num-layers", "2", "--enable-mechanism-monitor", "--no-such-flag", "3")
    assert res.returncode == 2, res.stderr[-3000:]
    assert "unrecognized arguments: --no-such-flag 3" in res.stderr


@pytest.fixture(scope="module")
def monitored(mlm, env, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("monitored")
    out_dir = cwd / "monitor"
    res = _launch(mlm, env, cwd, "--enable-mechanism-monitor", "--mechanism-monitor-interval", "5",
                  "--mechanism-monitor-delta", "5", "--mechanism-monitor-output", str(out_dir))
    return res, out_dir


def test_pretrain_gpt_trains_with_monitor(monitored):
    """20 steps of a tiny EP=2 MoE on 2 gloo ranks; monitor.jsonl has all three families at the
    steps Megatron-LM counts (interval 5; router every 10)."""
    res, out_dir = monitored
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    losses = _losses(res.stdout + res.stderr)
    assert sorted(losses) == list(range(1, 21))
    records = [json.loads(line) for line in (out_dir / "monitor.jsonl").read_text().splitlines() if line.strip()]
    assert records[0]["type"] == "config" and records[0]["num_experts"] == 4
    steps: dict[str, list[int]] = {}
    for rec in records:
        if rec.get("type") == "sample":
            steps.setdefault(rec["family"], []).append(rec["step"])
    assert steps.get("attention-spectral") == [5, 10, 15, 20]
    assert steps.get("update-spectral") == [5, 10, 15, 20]
    assert steps.get("router") == [10, 20]
    sample = next(r for r in records if r.get("family") == "update-spectral")
    assert set(sample["layers"]) == {"0", "1"}


def test_monitor_is_observation_only(mlm, env, tmp_path, monitored):
    """The same run without the monitor (patches and CPU layer still on) logs bit-identical losses."""
    res_on, _ = monitored
    assert res_on.returncode == 0
    res_off = _launch(mlm, env, tmp_path)
    assert res_off.returncode == 0, res_off.stdout[-3000:] + res_off.stderr[-6000:]
    off = _losses(res_off.stdout + res_off.stderr)
    assert off == _losses(res_on.stdout + res_on.stderr)
    assert len(off) == 20


def test_plan_reads_a_pretrain_gpt_checkpoint(mlm, env, tmp_path, capsys):
    """`mindspeed-proxy plan --load` on the legacy checkpoint pretrain_gpt.py writes: its args give the layout
    and the model, and the planner's parameter count equals the elements Megatron-LM stored."""
    import torch

    from mindspeed_proxy.checkpoint_io import safe_torch_load
    from mindspeed_proxy.cli import main as cli_main

    save = tmp_path / "ckpt"
    res = _launch(mlm, env, tmp_path, "--train-iters", "2", "--save", str(save), "--save-interval", "2",
                  "--ckpt-format", "torch")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    stored = 0
    for ep in range(2):  # rank 0 holds everything but the other EP rank's experts
        model = safe_torch_load(str(save / "iter_0000002" / f"mp_rank_00_{ep:03d}" / "model_optim_rng.pt"))["model"]
        stored += sum(t.numel() for k, t in model.items()
                      if isinstance(t, torch.Tensor) and (ep == 0 or ".experts." in k))
    assert cli_main(["plan", "--load", str(save), "--accelerator-memory-gib", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["original"]["params"] == stored
    assert (plan["original"]["K"], plan["original"]["ep"], plan["original"]["ranks"]) == (4, 2, 2)
    assert [(r["K"], r["ep"], r["ranks"]) for r in plan["proxies"]] == [(2, 1, 1)]
