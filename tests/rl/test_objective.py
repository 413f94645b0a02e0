"""The GRPO objective of one optimizer step against an independent float64 reference, in value and gradient.

The reference is written per sequence and per token with scalar float64 torch ops (autograd gives its
gradient): GSPO directly in its sequence form min(s_i·A_i, clip(s_i)·A_i), the aggregation modes as the
sums and means they define. Batches have lengths 1..T, an all-masked row and a constant-reward group.
"""
import math

import numpy as np
import pytest
import torch

from mindspeed_proxy.rl import aggregation
from mindspeed_proxy.rl.correction import Correction, icepop
from mindspeed_proxy.rl.losses import group_advantages, grpo_token_loss

F64 = torch.float64
B, T, G = 12, 9, 3  # rows, response length, group size
EPS_LOW, EPS_HIGH = 0.2, 0.28


def make_batch(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    lengths[4], lengths[7], lengths[9] = 0, 1, T  # an all-masked row, a one-token row, a full row
    mask = np.arange(T)[None, :] < lengths[:, None]
    old = rng.normal(scale=0.5, size=(B, T)) - 2.0
    logp = old + rng.normal(scale=0.3, size=(B, T))
    logp[0, 0] = old[0, 0] + 1.4  # ratio ~4 on a row with a negative advantage (dual-clip range)
    ref = old + rng.normal(scale=0.3, size=(B, T))
    rollout = old + rng.normal(scale=0.3, size=(B, T))
    entropy = rng.uniform(0.1, 2.0, size=(B, T))
    rewards = rng.integers(0, 3, size=B).astype(float)
    rewards[:G] = [0.0, 1.0, 1.0]  # row 0: negative advantage
    rewards[G:2 * G] = 1.0  # a constant-reward group: advantage 0
    adv, _ = group_advantages(torch.tensor(rewards, dtype=F64), G)
    return dict(logp=logp, old=old, ref=ref, rollout=rollout, entropy=entropy, adv=adv.numpy(), mask=mask)


def ref_kl(lp, rf, estimator):
    if estimator == "k1":
        return lp - rf
    if estimator == "k2":
        return 0.5 * (lp - rf) ** 2
    d = rf - lp
    return torch.exp(d) - d - 1.0


def reference_objective(batch, lp, cfg, mode):
    """The step's objective, scalar by scalar: returns a 0-d float64 tensor with autograd to `lp` [B, T]."""
    mask, old, rollout, ref, ent, adv = (batch[k] for k in ("mask", "old", "rollout", "ref", "entropy", "adv"))
    corr = cfg.get("correction") or Correction()
    rows = []  # per row: list of (token loss tensor), kept token count
    for i in range(B):
        tokens = [t for t in range(T) if mask[i, t]]
        k = {t: math.exp(old[i, t] - rollout[i, t]) for t in tokens}
        seq_weight = {"sequence": math.prod(k.values()) if tokens else 1.0,
                      "geometric": math.exp(sum(math.log(v) for v in k.values()) / len(tokens)) if tokens else 1.0}
        kept = list(tokens)
        if corr.rejection == "token":
            kept = [t for t in tokens if corr.low <= k[t] <= corr.high]
        elif corr.rejection is not None:
            kept = tokens if corr.low <= seq_weight[corr.rejection] <= corr.high else []
        a = float(adv[i])
        if cfg.get("gspo"):
            s = torch.exp(sum(lp[i, t] - old[i, t] for t in kept) / len(kept)) if kept else None
        terms = []
        for t in kept:
            w = 1.0
            if corr.is_level == "token":
                w = k[t]
            elif corr.is_level is not None:
                w = seq_weight[corr.is_level]
            if corr.is_level is not None and corr.truncation is not None:
                w = min(w, corr.truncation)
            r = s if cfg.get("gspo") else torch.exp(lp[i, t] - old[i, t])
            surrogate = torch.minimum(r * a, torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
            if cfg.get("dual_clip") and a < 0:
                surrogate = torch.maximum(surrogate, torch.tensor(cfg["dual_clip"] * a, dtype=F64))
            value = -w * surrogate
            value = value + cfg.get("kl_beta", 0.0) * ref_kl(lp[i, t], ref[i, t], cfg.get("kl", "k3"))
            value = value - cfg.get("entropy_weight", 0.0) * ent[i, t]
            terms.append(value)
        rows.append(terms)
    kept_rows = [terms for terms in rows if terms]
    zero = torch.zeros((), dtype=F64)
    if mode == "token-mean":
        return sum((v for terms in rows for v in terms), zero) / max(sum(len(x) for x in rows), 1)
    if mode == "seq-mean-token-mean":
        return sum((sum(terms) / len(terms) for terms in kept_rows), zero) / max(len(kept_rows), 1)
    if mode == "seq-mean-token-sum":
        return sum((sum(terms) for terms in kept_rows), zero) / max(len(kept_rows), 1)
    return sum((v for terms in rows for v in terms), zero) / (B * T)


def ours(batch, lp, cfg, mode, gspo_mode=None):
    loss, stats = grpo_token_loss(
        lp, torch.tensor(batch["old"]), torch.tensor(batch["ref"]), torch.tensor(batch["adv"]),
        torch.tensor(batch["mask"]), clamp_eps_lower=EPS_LOW, clamp_eps_upper=EPS_HIGH,
        kl_beta=cfg.get("kl_beta", 0.0), kl_estimator=cfg.get("kl", "k3"), entropy=torch.tensor(batch["entropy"]),
        entropy_weight=cfg.get("entropy_weight", 0.0), rollout_logp=torch.tensor(batch["rollout"]),
        correction=cfg.get("correction"), ratio_type="sequence" if cfg.get("gspo") else "token",
        dual_clip=cfg.get("dual_clip"))
    return aggregation.aggregate(loss, stats["kept"], gspo_mode or mode, T), stats


CONFIGS = {
    "plain": {},
    "kl-k1-entropy": dict(kl_beta=0.05, kl="k1", entropy_weight=0.01),
    "kl-k2": dict(kl_beta=0.05, kl="k2"),
    "kl-k3": dict(kl_beta=0.05, kl="k3"),
    "dual-clip": dict(dual_clip=3.0, kl_beta=0.01),
    "icepop": dict(correction=icepop(0.8, 1.25)),
    "icepop-mask-only": dict(correction=icepop(0.8, 1.25, weighted=False)),
    "tis-token": dict(correction=Correction(is_level="token", truncation=1.1)),
    "is-token-untruncated": dict(correction=Correction(is_level="token")),
    "is-sequence": dict(correction=Correction(is_level="sequence", truncation=2.0)),
    "is-geometric": dict(correction=Correction(is_level="geometric")),
    "reject-sequence": dict(correction=Correction(is_level="token", truncation=2.0, rejection="sequence",
                                                  low=0.5, high=2.0)),
    "reject-geometric": dict(correction=Correction(rejection="geometric", low=0.9, high=1.1)),
    "gspo": dict(gspo=True),
    "gspo-kl-icepop": dict(gspo=True, kl_beta=0.05, entropy_weight=0.01, correction=icepop(0.8, 1.25, weighted=False)),
}


def cases():
    for name, cfg in CONFIGS.items():
        for mode in aggregation.AGGREGATIONS:
            if not cfg.get("gspo") or mode == aggregation.GSPO_AGGREGATION:
                yield pytest.param(name, mode, id=f"{name}-{mode}")


@pytest.mark.parametrize("name,mode", list(cases()))
def test_objective_matches_float64_reference(name, mode):
    cfg = CONFIGS[name]
    for seed in (0, 1, 2):
        batch = make_batch(seed)
        lp_ref = torch.tensor(batch["logp"], requires_grad=True)
        expected = reference_objective(batch, lp_ref, cfg, mode)
        (grad_ref,) = torch.autograd.grad(expected, lp_ref, allow_unused=True)
        grad_ref = torch.zeros(B, T, dtype=F64) if grad_ref is None else grad_ref
        lp = torch.tensor(batch["logp"], requires_grad=True)
        value, stats = ours(batch, lp, cfg, mode)
        (grad,) = torch.autograd.grad(value, lp)
        np.testing.assert_allclose(value.item(), expected.item(), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(grad.numpy(), grad_ref.numpy(), rtol=1e-10, atol=1e-14)
        assert grad.abs().sum() > 0
    corr = cfg.get("correction")
    if corr is not None and corr.rejection is not None:
        assert not stats["kept"][torch.tensor(batch["mask"])].all()  # the rejection dropped something
    if cfg.get("dual_clip"):
        assert stats["clipped_dual"].any()


def test_every_clip_branch_is_exercised():
    batch = make_batch(0)
    _, stats = ours(batch, torch.tensor(batch["logp"]), dict(dual_clip=3.0), "token-mean")
    assert stats["clipped_low"].any() and stats["clipped_high"].any() and stats["clipped_dual"].any()


def test_old_gspo_aggregation_fails_the_exact_gspo_check():
    """The GSPO token form under a token mean (the former aggregation) weights long sequences more."""
    worst = 0.0
    for seed in range(3):
        batch = make_batch(seed)
        lp_ref = torch.tensor(batch["logp"], requires_grad=True)
        expected = reference_objective(batch, lp_ref, dict(gspo=True), "seq-mean-token-mean")
        (grad_ref,) = torch.autograd.grad(expected, lp_ref)
        lp = torch.tensor(batch["logp"], requires_grad=True)
        value, _ = ours(batch, lp, dict(gspo=True), None, gspo_mode="token-mean")
        (grad,) = torch.autograd.grad(value, lp)
        worst = max(worst, float((grad - grad_ref).norm() / grad_ref.norm()))
    assert worst > 0.1


def test_gspo_refuses_a_length_weighted_aggregation():
    for mode in aggregation.AGGREGATIONS:
        if mode != aggregation.GSPO_AGGREGATION:
            with pytest.raises(ValueError, match="GSPO"):
                aggregation.check(mode, "sequence")
    aggregation.check(aggregation.GSPO_AGGREGATION, "sequence")


def test_log_ratio_clamp_keeps_a_huge_ratio_finite():
    """A finite policy far from π_old (log ratio 400) with a negative advantage: finite loss and gradient."""
    lp = torch.tensor([[0.0, -1.0]], dtype=torch.float32, requires_grad=True)
    old = torch.tensor([[-400.0, -1.0]])
    for dual in (None, 3.0):
        loss, stats = grpo_token_loss(lp, old, None, torch.tensor([-1.0]), torch.ones(1, 2), clamp_eps_lower=0.2,
                                      clamp_eps_upper=0.2, dual_clip=dual, rollout_logp=old - 1000,
                                      correction=Correction(is_level="sequence"))
        value = aggregation.aggregate(loss, stats["kept"], "token-mean")
        (grad,) = torch.autograd.grad(value, lp)
        assert torch.isfinite(value) and torch.isfinite(grad).all()
        if dual is not None:
            assert stats["clipped_dual"][0, 0] and float(loss[0, 0]) == pytest.approx(3.0 * float(stats["is_weight"][0, 0]))  # −w·C·A, A = −1


def test_constant_reward_groups_keep_kl_and_entropy_unless_filtered():
    batch = make_batch(3)
    cfg = dict(kl_beta=0.1, entropy_weight=0.01)
    lp = torch.tensor(batch["logp"], requires_grad=True)
    value, _ = ours(batch, lp, cfg, "token-mean")
    (grad,) = torch.autograd.grad(value, lp)
    constant = slice(G, 2 * G)
    assert (batch["adv"][constant] == 0).all()
    assert grad[constant][torch.tensor(batch["mask"][constant])].abs().min() > 0  # KL acts on them
    filtered = dict(batch, mask=batch["mask"].copy())
    filtered["mask"][constant] = False  # --grpo-filter-groups-with-same-reward
    lp2 = torch.tensor(batch["logp"], requires_grad=True)
    value2, _ = ours(filtered, lp2, cfg, "token-mean")
    (grad2,) = torch.autograd.grad(value2, lp2)
    assert (grad2[constant] == 0).all() and float(value2) != float(value)


def test_top_k_and_top_p_sampling_keep_only_their_tokens():
    from mindspeed_proxy.rl.sampler import sample_from

    logp = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]] * 400), dim=-1)
    uniforms = torch.linspace(0, 0.9999, 400)
    assert set(sample_from(logp, uniforms, 0.0, 2).tolist()) == {0, 1}
    assert set(sample_from(logp, uniforms, 0.0, 1).tolist()) == {0}  # top-k 1 = greedy
    probs = logp[0].exp()
    nucleus = int((probs.cumsum(0) - probs < 0.8).sum())
    assert set(sample_from(logp, uniforms, 0.8, -1).tolist()) == set(range(nucleus))
    assert set(sample_from(logp, uniforms, 0.0, -1).tolist()) == set(range(5))  # both off (Megatron-LM's 0 / -1)
    # inside the kept set, the renormalised distribution: token 0's share under top-k 2
    share = float((sample_from(logp, uniforms, 0.0, 2) == 0).double().mean())
    assert share == pytest.approx(float(probs[0] / probs[:2].sum()), abs=0.01)


def test_rejected_fractions_and_ess_of_the_applied_weights():
    from mindspeed_proxy.rl.correction import rollout_correction
    from mindspeed_proxy.rl.stats import finalize_importance, finalize_rejection, importance_sums, rejection_sums

    batch = make_batch(4)
    mask = torch.tensor(batch["mask"])
    old, rollout = torch.tensor(batch["old"]), torch.tensor(batch["rollout"])
    weights, kept = rollout_correction(old, rollout, mask, Correction(is_level="geometric", rejection="geometric",
                                                                      low=0.95, high=1.05))
    rows = [i for i in range(B) if batch["mask"][i].any()]
    geo = {i: math.exp(float((old[i] - rollout[i])[mask[i]].mean())) for i in rows}
    out = [i for i in rows if not 0.95 <= geo[i] <= 1.05]
    assert 0 < len(out) < len(rows)
    metrics = finalize_rejection(rejection_sums(kept, mask))
    assert metrics["rejected_seq_frac"] == pytest.approx(len(out) / len(rows), abs=1e-15)
    assert metrics["rejected_token_frac"] == pytest.approx(sum(int(mask[i].sum()) for i in out) / int(mask.sum()))
    applied = [geo[i] for i in rows if i not in out for _ in range(int(mask[i].sum()))]
    ess = finalize_importance(importance_sums(weights, kept))["ess"]
    assert ess == pytest.approx(sum(applied) ** 2 / (len(applied) * sum(w * w for w in applied)), rel=1e-12)
