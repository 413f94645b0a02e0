"""Megatron-LM's `train_rl.py` (unmodified, CPU, 2 gloo ranks, EP=2, rollouts from megatron-core's dynamic engine)
with `--enable-mechanism-monitor`: the rl family at train_rl.py's iterations, checked in float64, and R3.

The launch wraps `mindspeed_proxy.run` in a script that saves, per rank and update, what the rl rows saw before
they reduce it (the aligned inference logprobs, pi_old, the mask, the entropy, the pi_old pass's experts, the
rollout table recorded from the engine). The test recomputes the rl sample from those tensors in float64, with
its own matching of rows to the engine's requests, and compares it with monitor.jsonl. With
`--mechanism-routing-replay r3` every iteration reads no routing mismatch and no flip in the gap.
Needs what tests/test_megatron_lm.py needs plus the `rl` extra; skips otherwise.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_megatron_lm import env, mlm, pytestmark  # noqa: F401  (fixtures, skip reason)

ITERS = 3
FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "16", "--max-position-embeddings", "16",
    "--bf16", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4",
    "--lr-decay-style", "constant", "--num-experts", "8", "--moe-router-topk", "2",
    "--moe-token-dispatcher-type", "alltoall", "--transformer-impl", "local", "--tokenizer-type",
    "HuggingFaceTokenizer", "--no-gradient-accumulation-fusion", "--no-bias-swiglu-fusion",
    "--no-masked-softmax-fusion", "--no-rope-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
    "--disable-bias-linear", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
    "--distributed-backend", "gloo", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
    "--seed", "1234", "--perform-rl-step", "--langrl-inference-server-type", "inplace_megatron",
    "--grpo-prompts-per-step", "2", "--grpo-group-size", "4", "--grpo-iterations", "1",
    "--rl-parallel-generation-tasks", "4", "--inference-max-seq-length", "16",
    "--inference-dynamic-batching-buffer-size-gb", "0.02", "--inference-dynamic-batching-max-requests", "8",
    "--inference-dynamic-batching-max-tokens", "512", "--expert-model-parallel-size", "2",
    "--train-iters", str(ITERS), "--enable-mechanism-monitor", "--mechanism-monitor-rl-gap-interval", "1",
]
DUMP = '''
import os, runpy, sys, torch
from mindspeed_proxy.patches import rl_capture
from mindspeed_proxy.patches.runtime import RUNTIME
original = rl_capture.Capture.finish
def finish(self, group, model=None, micro_batch=None):
    if self.aligned is not None:
        torch.save({"aligned": self.aligned, "entropy": list(self.entropy), "rows": list(self.rows),
                    "forwards": list(self.train_routing.forwards), "requests": self.table.requests},
                   os.path.join(os.environ["RL_DUMP"], f"rank{torch.distributed.get_rank()}_step{RUNTIME.current_step()}.pt"))
    return original(self, group, model=model, micro_batch=micro_batch)
rl_capture.Capture.finish = finish
sys.argv = sys.argv[1:]
runpy.run_module("mindspeed_proxy.run", run_name="__main__")
'''


def _launch(mlm: Path, env: dict, cwd: Path, *extra: str):
    from mindspeed_proxy.rl.megatron_agents import env_config
    from mindspeed_proxy.rl.tokenizer_dir import write_tokenizer

    tokenizer = write_tokenizer(cwd / "tokenizer")
    (cwd / "digits.yaml").write_text(yaml.safe_dump(env_config("reverse", 0.5)))
    (cwd / "dump").mkdir()
    (cwd / "dump_run.py").write_text(DUMP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(cwd / "dump_run.py"), "mindspeed_proxy.run", str(mlm / "train_rl.py"), *FLAGS,
           "--tokenizer-model", str(tokenizer), "--langrl-env-config", str(cwd / "digits.yaml"),
           "--mechanism-monitor-output", str(cwd / "monitor"), *extra]
    res = subprocess.run(cmd, env={**env, "RL_DUMP": str(cwd / "dump")}, cwd=cwd, capture_output=True, text=True,
                         timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    samples = {}
    for line in (cwd / "monitor" / "monitor.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("type") == "sample" and record["family"] == "rl":
            samples[record["step"]] = record["layers"]
    return samples


def _reference(dumps: list) -> dict:
    """float64 rl values of one update from every rank's dump (own row -> request matching)."""
    import torch

    k3 = ent = tokens = 0.0
    same = [0.0, 0.0]
    anym = routed = 0
    for dump in dumps:
        inference, old, mask = (t.double() for t in dump["aligned"])
        entropy = torch.cat(dump["entropy"]).double()
        d = (old - inference)[mask.bool()]
        k3, tokens = k3 + float((torch.expm1(d) - d).sum()), tokens + d.numel()
        ent += float(entropy[mask.bool()].sum())
        train = torch.cat(dump["forwards"])  # [B, S, L, k]
        for b, row in enumerate(torch.cat(dump["rows"]).tolist()):
            request = next(r for _, r in sorted(dump["requests"].items(), key=lambda kv: (kv[0][1], kv[0][0]))
                           if all(row[p] == t for p, t in r[0].items()) and set(r[0]) == set(range(len(r[0]))))
            for pos in range(len(request[0])):
                differs = False
                for li, layer in enumerate(sorted(request[1])):
                    equal = set(request[1][layer][pos]) == set(train[b, pos, li].tolist())
                    same[li] += equal
                    differs |= not equal
                anym, routed = anym + differs, routed + 1
    return {"mismatch_k3_kl": k3 / tokens, "entropy": ent / tokens, "topk_match": [s / routed for s in same],
            "any_layer_mismatch": anym / routed}


@pytest.fixture(scope="module")
def rl_env(env, mlm):
    """The checkout environment, after checking Megatron-LM's RL imports there."""
    probe = subprocess.run([sys.executable, "-c", "import zmq, fastapi, uvicorn, httpx, megatron.rl.rl_utils"],
                           env=env, cwd=mlm, capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"Megatron-LM's RL does not import here ({(probe.stderr.strip().splitlines() or ['?'])[-1]})")
    return env


def test_rl_family_at_train_rl_iterations_equals_float64(mlm, rl_env, tmp_path):
    """An rl sample at each of train_rl.py's iterations, equal to the float64 recomputation of what the rows saw."""
    import torch

    samples = _launch(mlm, rl_env, tmp_path)
    assert sorted(samples) == list(range(1, ITERS + 1))
    for step, got in samples.items():
        ref = _reference([torch.load(tmp_path / "dump" / f"rank{r}_step{step}.pt", weights_only=False)
                          for r in range(2)])
        assert got["all"]["mismatch_k3_kl"] == pytest.approx(ref["mismatch_k3_kl"], rel=1e-9, abs=1e-15)
        assert got["all"]["entropy"] == pytest.approx(ref["entropy"], rel=1e-6)
        assert got["all"]["any_layer_mismatch"] == pytest.approx(ref["any_layer_mismatch"], abs=1e-12)
        assert [got[k]["topk_match"] for k in ("0", "1")] == pytest.approx(ref["topk_match"], abs=1e-12)
        assert math.isfinite(got["all"]["gap_abs_mean"])


def test_r3_reads_no_routing_mismatch(mlm, rl_env, tmp_path):
    """--mechanism-routing-replay r3: every iteration's rollout and pi_old experts agree; the gap has no flip."""
    samples = _launch(mlm, rl_env, tmp_path, "--mechanism-routing-replay", "r3")
    assert sorted(samples) == list(range(1, ITERS + 1))
    for step, got in samples.items():
        assert got["all"]["any_layer_mismatch"] == 0.0 and got["0"]["topk_match"] == got["1"]["topk_match"] == 1.0
        assert got["all"]["gap_flip_share"] == 0.0 and got["all"]["gap_flipped_token_frac"] == 0.0
