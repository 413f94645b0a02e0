"""Megatron-LM's own `train_rl.py`, unmodified, on CPU through `mindspeed_proxy.run` (GRPO, 2 gloo ranks, EP=2).

Needs a Megatron-LM checkout (core_v0.16 line) named by MEGATRON_LM_PATH and, importable through PYTHONPATH,
its training deps (as for tests/test_megatron_lm.py) plus the `rl` extra (fastapi, uvicorn, httpx, datasets,
wandb, pyzmq; docs/megatron_lm.md, section train_rl.py). Skips with the reason otherwise; CI has no checkout.
The rollouts come from megatron-core's dynamic inference engine run in place on the training model; the task
is the digit-reversal task of our own loop as an offline agent (mindspeed_proxy.rl.megatron_agents), the
tokenizer a character-level folder written by `mindspeed-proxy write-tokenizer`.

Reusable by other tests: `prepare_inputs`, `train_rl_flags`, `launch_train_rl`, `iterations`, `logged_rollouts`
(import them with the fixtures, as tests/test_megatron_lm_tp.py does with test_megatron_lm).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mindspeed_proxy.rl.megatron_agents import digit_reward, env_config
from mindspeed_proxy.rl.tokenizer_dir import write_tokenizer
from test_megatron_lm import env, mlm, pytestmark  # noqa: F401  (fixtures, skip reason)

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \| rl/kl_term: ([0-9.E+-]+)")

# Tiny GPT-MoE (2 layers, GQA, RoPE, RMSNorm, SwiGLU, 8 experts top-2) and GRPO: 2 prompts x 4 samples per step,
# one step per collection; the dynamic engine's GPU-sized defaults shrunk to a few requests and tokens.
MODEL_FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--seq-length", "16", "--max-position-embeddings", "16", "--bf16",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "constant",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
    "--transformer-impl", "local", "--tokenizer-type", "HuggingFaceTokenizer",
    "--no-gradient-accumulation-fusion", "--no-bias-swiglu-fusion", "--no-masked-softmax-fusion",
    "--no-rope-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
    "--disable-bias-linear", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
    "--distributed-backend", "gloo", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
    "--seed", "1234",
]
RL_FLAGS = [
    "--perform-rl-step", "--langrl-inference-server-type", "inplace_megatron",
    "--grpo-prompts-per-step", "2", "--grpo-group-size", "4", "--grpo-iterations", "1",
    "--rl-parallel-generation-tasks", "4", "--inference-max-seq-length", "16",
    "--inference-dynamic-batching-buffer-size-gb", "0.02", "--inference-dynamic-batching-max-requests", "8",
    "--inference-dynamic-batching-max-tokens", "512",
]


def prepare_inputs(workdir: Path, task: str = "reverse", partial_credit: float = 0.5) -> tuple[Path, Path]:
    """Write the tokenizer folder and the --langrl-env-config YAML under `workdir`; return their paths.
    Partial credit lets an untrained policy earn some reward (an exact reversal is rare)."""
    tokenizer = write_tokenizer(workdir / "tokenizer")
    config = workdir / "digits.yaml"
    config.write_text(yaml.safe_dump(env_config(task, partial_credit)))
    return tokenizer, config


def train_rl_flags(tokenizer: Path, config: Path, iters: int = 3, ep: int = 2, tp: int = 1) -> list[str]:
    """train_rl.py's flags for the tiny model at EP=`ep`, TP=`tp` (TP>1 adds sequence parallelism)."""
    layout = ["--expert-model-parallel-size", str(ep), "--tensor-model-parallel-size", str(tp)]
    if tp > 1:
        layout.append("--sequence-parallel")
    return [*MODEL_FLAGS, *RL_FLAGS, *layout, "--train-iters", str(iters), "--tokenizer-model", str(tokenizer),
            "--langrl-env-config", str(config)]


def launch_train_rl(mlm: Path, env: dict, cwd: Path, *extra: str, iters: int = 3, ep: int = 2, tp: int = 1,
                    nproc: int = 2, timeout: int = 900) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node N -m mindspeed_proxy.run train_rl.py ...` in `cwd`; rollouts pickled to cwd/langrl."""
    tokenizer, config = prepare_inputs(cwd)
    (cwd / "langrl").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           "-m", "mindspeed_proxy.run", str(mlm / "train_rl.py"),
           *train_rl_flags(tokenizer, config, iters, ep, tp), *extra]
    return subprocess.run(cmd, env={**env, "LANGRL_LOG_DIR": str(cwd / "langrl")}, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def iterations(output: str) -> dict[int, tuple[float, float]]:
    """Iteration -> (lm loss, rl/kl_term) from Megatron-LM's log lines."""
    return {int(i): (float(loss), float(kl)) for i, loss, kl in ITERATION.findall(output)}


def logged_rollouts(env: dict, cwd: Path) -> dict[int, list[dict]]:
    """Iteration (0-based, Megatron-LM's curr_iteration) -> the rollouts rank 0 pickled: token ids and reward."""
    script = (
        "import json, pathlib, pickle, re, sys\n"
        "out = {}\n"
        "for f in sorted(pathlib.Path(sys.argv[1]).glob('rollouts_rank0_iteration*_*.pkl')):\n"
        "    it = int(re.search(r'iteration(\\d+)_', f.name).group(1))\n"
        "    groups = pickle.loads(f.read_bytes())\n"
        "    out[it] = [{'group': g, 'tokens': r.trajectory[0], 'mask': r.generation_mask[0], 'reward': r.reward,\n"
        "                'env_id': r.env_id} for g, group in enumerate(groups) for r in group]\n"
        "print(json.dumps(out))\n")
    res = subprocess.run([sys.executable, "-c", script, str(cwd / "langrl")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return {int(k): v for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}


@pytest.fixture(scope="module")
def rl_env(env, mlm):
    """The checkout environment, after checking Megatron-LM's RL and the `rl` extra import there."""
    probe = subprocess.run([sys.executable, "-c", "import zmq, fastapi, uvicorn, httpx, datasets, wandb, "
                            "megatron.rl.rl_utils, megatron.rl.inference.megatron"],
                           env=env, cwd=mlm, capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"Megatron-LM's RL does not import here ({last}); install the `rl` extra "
                    "(docs/megatron_lm.md, section train_rl.py)")
    return env


def _check_run(res, rl_env, cwd, iters):
    """What every train_rl.py run must show: all iterations logged with finite losses, a rollout collection per
    iteration whose rewards are the task's rewards of the decoded responses, and a clean exit."""
    from transformers import AutoTokenizer

    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    logged = iterations(res.stdout + res.stderr)
    assert sorted(logged) == list(range(1, iters + 1)), res.stdout[-3000:]
    assert all(abs(loss) < 1e3 and kl >= 0 for loss, kl in logged.values())
    rollouts = logged_rollouts(rl_env, cwd)
    assert sorted(rollouts) == list(range(iters))
    tokenizer = AutoTokenizer.from_pretrained(str(cwd / "tokenizer"))
    for batch in rollouts.values():
        assert len(batch) == 8 and {r["group"] for r in batch} == {0, 1}
        for r in batch:
            prompt_ids = [t for t, gen in zip(r["tokens"], r["mask"]) if not gen]
            response_ids = [t for t, gen in zip(r["tokens"], r["mask"]) if gen]
            prompt = tokenizer.decode(prompt_ids)
            assert re.fullmatch(r"[0-9]{4,6}=", prompt), prompt
            assert r["env_id"] == "digits-reverse"
            assert r["reward"] == pytest.approx(digit_reward("reverse", prompt, tokenizer.decode(response_ids), 0.5))
            assert 0.0 <= r["reward"] <= 1.0
    return logged


@pytest.fixture(scope="module")
def plain_run(mlm, rl_env, tmp_path_factory):
    """3 GRPO iterations of train_rl.py without the monitor (the platform layer and patches on)."""
    cwd = tmp_path_factory.mktemp("train_rl")
    return launch_train_rl(mlm, rl_env, cwd, iters=3), cwd


def test_train_rl_runs_on_cpu(rl_env, plain_run):
    """3 GRPO iterations of train_rl.py at EP=2 on 2 gloo ranks: iterations logged, rewards recomputed, exit 0."""
    res, cwd = plain_run
    _check_run(res, rl_env, cwd, 3)


def test_train_rl_with_monitor(mlm, rl_env, plain_run, tmp_path):
    """The same launch with --enable-mechanism-monitor: monitor.jsonl has samples at train_rl.py's iterations, and
    the run logs exactly the losses of the run without it (the monitor only observes)."""
    out_dir = tmp_path / "monitor"
    res = launch_train_rl(mlm, rl_env, tmp_path, "--enable-mechanism-monitor", "--mechanism-monitor-interval", "1",
                          "--mechanism-monitor-delta", "1", "--mechanism-monitor-output", str(out_dir), iters=3)
    logged = _check_run(res, rl_env, tmp_path, 3)
    plain, _ = plain_run
    assert plain.returncode == 0 and logged == iterations(plain.stdout + plain.stderr)
    records = [json.loads(line) for line in (out_dir / "monitor.jsonl").read_text().splitlines() if line.strip()]
    assert records[0]["type"] == "config" and records[0]["num_experts"] == 8
    steps: dict[str, list[int]] = {}
    for rec in records:
        if rec.get("type") == "sample":
            steps.setdefault(rec["family"], []).append(rec["step"])
    assert steps.get("update-spectral") == [1, 2, 3]
    assert steps.get("attention-spectral") == [1, 2, 3]


def test_proxy_of_a_train_rl_checkpoint_trains(mlm, rl_env, tmp_path):
    """A train_rl.py checkpoint (8 experts, EP=2, 2 iterations, legacy format) converts with the README's
    plain command to 4 experts at EP=1, and train_rl.py trains that proxy for 2 iterations on the printed number of
    ranks with the printed flags appended (its rollouts come from the proxy)."""
    from test_megatron_lm_convert import convert

    (tmp_path / "source").mkdir()
    source = launch_train_rl(mlm, rl_env, tmp_path / "source", "--save", str(tmp_path / "ckpt"),
                             "--save-interval", "2", "--ckpt-format", "torch", iters=2)
    _check_run(source, rl_env, tmp_path / "source", 2)
    flags, ranks, printed = convert(rl_env, tmp_path, tmp_path / "ckpt", tmp_path / "proxy", 1, 4)
    assert ranks == 1 and "--num-experts" in flags and flags[flags.index("--num-experts") + 1] == "4", printed
    (tmp_path / "proxy_run").mkdir()
    res = launch_train_rl(mlm, rl_env, tmp_path / "proxy_run", *flags, iters=2, ep=1, nproc=ranks)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    out = res.stdout + res.stderr
    assert f"successfully loaded checkpoint from {tmp_path / 'proxy'}" in out
    assert re.findall(r"iteration\s+(\d+)/\s*2 \|", out) == ["1", "2"]
    assert sorted(logged_rollouts(rl_env, tmp_path / "proxy_run")) == [0, 1]
