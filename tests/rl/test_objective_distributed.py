"""The GRPO objective on real megatron-core: the same loss and gradient norm at EP=2 / DP=2 on 2 ranks as on
1 rank, with 1 or 4 micro-batches, for every aggregation mode; a non-finite step is never applied.

One 2-rank job and one 1-rank job; each runs every mode (from the same weights, restored before each step).
"""
from __future__ import annotations

import math

import pytest

from mindspeed_proxy.testing import run_distributed

ROWS, PROMPT, RESPONSE, GROUP = 16, 4, 6, 4
MODES = {
    "token-mean": dict(aggregation="token-mean", kl_beta=0.01),
    "seq-mean-token-mean+dual-clip+k2": dict(aggregation="seq-mean-token-mean", dual_clip=3.0, kl_beta=0.05,
                                             kl_estimator="k2"),
    "seq-mean-token-sum+icepop": dict(aggregation="seq-mean-token-sum",
                                      correction=dict(is_level="token", rejection="token", low=0.7, high=1.4)),
    "dr-grpo+is-sequence+entropy": dict(aggregation="seq-mean-token-sum-norm", entropy_weight=0.01,
                                         correction=dict(is_level="sequence", truncation=2.0)),
    "gspo": dict(aggregation="seq-mean-token-mean", ratio_type="sequence", kl_beta=0.01),
    "token-mean+reject-geometric": dict(aggregation="token-mean",
                                        correction=dict(rejection="geometric", low=0.9, high=1.1)),
    "token-mean+tis+k1": dict(aggregation="token-mean", kl_beta=0.02, kl_estimator="k1",
                              correction=dict(is_level="token", truncation=1.1)),
    "seq-mean-token-mean+is-geometric": dict(aggregation="seq-mean-token-mean",
                                             correction=dict(is_level="geometric")),
    "seq-mean-token-sum+icepop-mask-only": dict(aggregation="seq-mean-token-sum",
                                                correction=dict(rejection="token", low=0.7, high=1.4)),
    "token-mean+reject-sequence+is-token": dict(aggregation="token-mean", correction=dict(
        is_level="token", rejection="sequence", low=0.3, high=3.0)),
}


def _correction(spec):
    from mindspeed_proxy.rl.correction import Correction

    return Correction(**(spec or {}))


def _global_batch(engine):
    """The step's global batch (same on every rank): tokens, masks, logprobs around the policy's, advantages."""
    import torch

    from mindspeed_proxy.rl.losses import group_advantages

    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 256, (ROWS, PROMPT + RESPONSE), generator=g)
    lengths = torch.randint(1, RESPONSE + 1, (ROWS,), generator=g)
    lengths[3], lengths[5], lengths[12] = 0, 1, RESPONSE  # an all-masked row, a one-token row, a full row
    mask = (torch.arange(RESPONSE)[None, :] < lengths[:, None]).float()
    logp, _, _ = engine.logprob_pass(tokens, PROMPT)
    noise = lambda scale: torch.randn(ROWS, RESPONSE, generator=g) * scale  # noqa: E731
    old = logp + noise(0.3)
    old[0, 0] = logp[0, 0] - 1.5  # ratio ~4.5 on a negative-advantage row (dual-clip)
    rewards = torch.randint(0, 2, (ROWS,), generator=g).double()
    rewards[:GROUP] = torch.tensor([0.0, 1.0, 1.0, 1.0])
    rewards[GROUP:2 * GROUP] = 1.0  # a constant-reward group (kept, advantage 0: Megatron-LM's default)
    advantages, _ = group_advantages(rewards, GROUP)
    return {"tokens": tokens, "old_logp": old, "ref_logp": logp + noise(0.2), "rollout_logp": old + noise(0.2),
            "mask": mask, "advantages": advantages.float(), "routing": None, "prompt_length": PROMPT}


def _run(ep: int) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from mindspeed_proxy.layout_init import global_init
    from mindspeed_proxy.rl.update import GRPOConfig, GRPOEngine
    from mindspeed_proxy.rl.weights import snapshot
    from mindspeed_proxy.testing.parallel import init_parallel
    from mindspeed_proxy.tiny_moe import TinyMoEConfig
    from mindspeed_proxy.training.engine import TrainConfig, Trainer

    init_parallel(ep=ep)
    model_cfg = TinyMoEConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, moe_ffn_hidden_size=32,
                              seq_length=PROMPT + RESPONSE)
    trainer = Trainer(model_cfg, TrainConfig(micro_batch_size=4, global_batch_size=ROWS, lr=1e-2, min_lr=1e-2,
                                             lr_decay_style="constant", clip_grad=0.0),
                      init_fn=lambda m: global_init(m, seed=5))
    engine = GRPOEngine(trainer, GRPOConfig())
    batch = _global_batch(engine)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = ROWS // dp
    rows = torch.arange(rank * per_rank, (rank + 1) * per_rank)
    params = list(engine.model.parameters())
    start = snapshot(engine.model)

    def restore():
        with torch.no_grad():
            for p, w in zip(params, start):
                p.copy_(w)

    out = {}
    for name, spec in MODES.items():
        spec = dict(spec)
        engine.cfg = GRPOConfig(correction=_correction(spec.pop("correction", None)), **spec)
        for micro in (1, 4):
            trainer.cfg.micro_batch_size = per_rank // micro
            restore()
            result = engine.train_step(batch, rows, 1)
            moved = any(not torch.equal(p, w) for p, w in zip(params, start))
            out[(name, micro)] = (result["loss"], result["grad_norm"], result["skipped"], moved)
    # a NaN advantage poisons the loss: the step is not applied, the next finite one is
    engine.cfg = GRPOConfig(aggregation="token-mean")
    restore()
    poisoned = {**batch, "advantages": batch["advantages"].clone()}
    poisoned["advantages"][rank * per_rank + 1] = math.nan  # one row of each data-parallel rank
    bad = engine.train_step(poisoned, rows, 1)
    unchanged = all(torch.equal(p, w) for p, w in zip(params, start))
    good = engine.train_step(batch, rows, 1)
    out["nan"] = (bad["skipped"], bad["nonfinite"], unchanged, good["skipped"], math.isfinite(good["grad_norm"]),
                  all(torch.isfinite(p).all() for p in params))
    return out


@pytest.fixture(scope="module")
def runs():
    two = run_distributed(_run, 2, 2, timeout=600)
    one = run_distributed(_run, 1, 1, timeout=300)[0]
    return one, two


@pytest.mark.parametrize("name", list(MODES))
def test_mode_is_layout_and_microbatch_independent(runs, name):
    one, two = runs
    reference = one[(name, 1)]
    loss, grad_norm = reference[0], reference[1]
    assert math.isfinite(loss) and grad_norm > 0
    for result in [one[(name, 4)]] + [r[(name, m)] for r in two for m in (1, 4)]:
        assert result[0] == pytest.approx(loss, rel=1e-5, abs=1e-8)
        assert result[1] == pytest.approx(grad_norm, rel=1e-5)
        assert not result[2] and result[3]  # applied, and it moved the weights


def test_modes_differ(runs):
    one, _ = runs
    losses = [one[(name, 1)][0] for name in MODES]
    assert len({round(x, 9) for x in losses}) == len(losses)


def test_non_finite_step_is_never_applied_on_one_rank_and_at_ep2(runs):
    one, two = runs
    for out in [one] + list(two):
        skipped, nonfinite, unchanged, next_skipped, next_finite, weights_finite = out["nan"]
        assert skipped and nonfinite and unchanged
        assert not next_skipped and next_finite and weights_finite
