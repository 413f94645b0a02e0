"""Our token-level GRPO loss against Megatron-LM's own `calculate_grpo_loss` on the same tensors.

Needs a Megatron-LM checkout (core_v0.16 line) named by env MEGATRON_LM_PATH (see tests/test_megatron_lm.py).
`megatron/rl/rl_utils.py` imports Megatron-LM's whole RL stack (inference server, agents, triton, fastapi,
...), so the test takes the function's own source from that file (Python's ast) and runs it on torch alone.
"""
from __future__ import annotations

import ast
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from mindspeed_proxy.rl import aggregation
from mindspeed_proxy.rl.correction import Correction
from mindspeed_proxy.rl.losses import grpo_token_loss

MLM = os.environ.get("MEGATRON_LM_PATH", "")
pytestmark = pytest.mark.skipif(not MLM, reason="MEGATRON_LM_PATH is not set: this test needs a Megatron-LM checkout "
                                                "(core_v0.16 line), which CI does not have")


@pytest.fixture(scope="module")
def calculate_grpo_loss():
    """Megatron-LM's calculate_grpo_loss, compiled from the checkout's megatron/rl/rl_utils.py."""
    path = Path(MLM) / "megatron" / "rl" / "rl_utils.py"
    if not path.is_file():
        pytest.skip(f"MEGATRON_LM_PATH={MLM} has no megatron/rl/rl_utils.py")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "calculate_grpo_loss"]
    namespace = {"torch": torch, "logging": logging, "logger": logging.getLogger("mlm"),
                 "log_single_rank": lambda *a, **k: None}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["calculate_grpo_loss"]


@pytest.mark.parametrize("inference, truncation, entropy_weight", [
    (False, None, 0.0), (True, None, 0.0), (True, 1.2, 0.0), (True, 1.5, 0.01)])
def test_token_loss_equals_megatron_lm(calculate_grpo_loss, inference, truncation, entropy_weight):
    rng = np.random.default_rng(7)
    batch, length = 6, 8
    old = torch.tensor(rng.normal(scale=0.5, size=(batch, length)) - 2.0)
    current = old + torch.tensor(rng.normal(scale=0.3, size=(batch, length)))
    ref = old + torch.tensor(rng.normal(scale=0.3, size=(batch, length)))
    rollout = old + torch.tensor(rng.normal(scale=0.3, size=(batch, length)))
    advantages = torch.tensor(rng.normal(size=batch))
    eps_low, eps_high, beta = 0.2, 0.28, 0.05
    mask = torch.ones(batch, length, dtype=torch.bool)

    theirs_lp = current.clone().requires_grad_(True)
    theirs = calculate_grpo_loss(theirs_lp, old, ref, advantages, eps_low, eps_high, beta, entropy_weight,
                                 inference_logprobs=rollout if inference else None, is_truncation_coef=truncation)
    loss_theirs, kl_theirs, ratio_theirs = theirs[:3]

    ours_lp = current.clone().requires_grad_(True)
    entropy = -ours_lp.exp() * ours_lp  # Megatron-LM's entropy term: −p·log p of the sampled token
    loss_ours, stats = grpo_token_loss(
        ours_lp, old, ref, advantages, mask, clamp_eps_lower=eps_low, clamp_eps_upper=eps_high, kl_beta=beta,
        entropy=entropy, entropy_weight=entropy_weight, rollout_logp=rollout,
        correction=Correction(is_level="token", truncation=truncation) if inference else None)
    torch.testing.assert_close(loss_ours, loss_theirs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(stats["kl"], kl_theirs.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(stats["ratio"], ratio_theirs.detach(), rtol=1e-12, atol=1e-14)
    # train_rl.py's loss_func: Σ(loss·mask) / Σ mask per micro-batch = our token-mean over one micro-batch
    ours = aggregation.aggregate(loss_ours, mask, "token-mean")
    theirs_mean = loss_theirs.sum() / mask.sum()
    (g_ours,) = torch.autograd.grad(ours, ours_lp)
    (g_theirs,) = torch.autograd.grad(theirs_mean, theirs_lp)
    torch.testing.assert_close(ours, theirs_mean, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-10, atol=1e-14)
    if inference and truncation is not None:
        assert (stats["is_weight"] == truncation).any()  # the truncation acted
