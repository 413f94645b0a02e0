"""GRPO loss and rollout-diagnostic math against float64 references written as plain loops over rows and tokens."""
import math

import numpy as np
import pytest
import torch

from mindspeed_proxy.rl.correction import Correction
from mindspeed_proxy.rl.losses import (
    group_advantages,
    grpo_token_loss,
    gspo_sequence_ratio,
    icepop_mask,
    k3_kl,
    masked_mean,
    tis_weights,
)
from mindspeed_proxy.rl.stats import (
    IMPORTANCE_MAX_ENTRY,
    finalize_importance,
    finalize_mismatch,
    finalize_routing,
    importance_sums,
    load_drift,
    mismatch_sums,
    routing_consistency_sums,
)

TOL = 1e-12
F64 = torch.float64


def t64(x):
    return torch.tensor(np.asarray(x), dtype=F64)


def assert_close(actual, expected, tol=TOL):
    if isinstance(actual, torch.Tensor):
        actual = actual.detach()
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64),
                               rtol=tol, atol=tol)


def random_mask(rng, batch, length):
    """Rows of different lengths (a prefix of valid tokens), row 1 fully masked."""
    lengths = rng.integers(1, length + 1, size=batch)
    lengths[1] = 0
    return np.arange(length)[None, :] < lengths[:, None]


# ---------------------------------------------------------------- group advantages

def reference_advantages(rewards, group_size, eps):
    out, nonzero = [], []
    for g in range(len(rewards) // group_size):
        group = [float(r) for r in rewards[g * group_size:(g + 1) * group_size]]
        mean = sum(group) / group_size
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / group_size)
        constant = all(r == group[0] for r in group)
        nonzero.append(not constant)
        out.extend(0.0 if constant else (r - mean) / (std + eps) for r in group)
    return out, nonzero


@pytest.mark.parametrize("num_groups,group_size", [(1, 2), (1, 3), (1, 7), (3, 3), (4, 4), (2, 7), (5, 8)])
def test_group_advantages_population_std(num_groups, group_size):
    rng = np.random.default_rng(group_size)
    rewards = rng.normal(size=num_groups * group_size)
    rewards[:group_size] = 0.1  # a constant group whose float mean is not exactly 0.1
    if num_groups > 2:
        rewards[group_size:2 * group_size] = rng.integers(0, 2, size=group_size)
        rewards[group_size] = 1.0 - rewards[group_size + 1]  # binary group, surely not constant
    for eps in (1e-4, 0.0):
        adv, nonzero = group_advantages(t64(rewards), group_size, eps=eps)
        ref_adv, ref_nonzero = reference_advantages(rewards, group_size, eps)
        assert adv.dtype == F64 and nonzero.dtype == torch.bool
        assert_close(adv, ref_adv)
        assert nonzero.tolist() == ref_nonzero
        assert not nonzero[0] and (adv[:group_size] == 0).all()


def test_group_advantages_dtypes_and_errors():
    rewards = [1.0, 0.0, 0.0, 0.0, 2.0, 2.0]
    ref, _ = reference_advantages(rewards, 2, 1e-4)
    for dtype, out_dtype in ((torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                             (torch.int64, torch.float32), (torch.float32, torch.float32)):
        adv, nonzero = group_advantages(torch.tensor(rewards).to(dtype), 2)
        assert adv.dtype == out_dtype
        assert nonzero.tolist() == [True, False, False]
        assert_close(adv, ref, tol=1e-6)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(6), 1)


# ---------------------------------------------------------------- per-token pieces

def test_k3_kl_and_tis_and_icepop_match_scalar_formulas():
    rng = np.random.default_rng(1)
    logp, ref, rollout = (rng.normal(scale=0.7, size=(4, 9)) - 1.5 for _ in range(3))
    rollout[0, :3] = logp[0, :3]  # ratio exactly 1
    kl, expected_kl = k3_kl(t64(logp), t64(ref)), np.zeros_like(logp)
    for (b, t), lp in np.ndenumerate(logp):
        d = ref[b, t] - lp
        expected_kl[b, t] = math.exp(d) - d - 1.0
    assert_close(kl, expected_kl)
    assert (kl >= 0).all() and (k3_kl(t64(logp), t64(logp)) == 0).all()

    old = t64(logp).requires_grad_(True)
    for truncation in (None, 1.3):
        w = tis_weights(old, t64(rollout), truncation)
        assert not w.requires_grad
        expected = [[min(math.exp(logp[b, t] - rollout[b, t]), truncation or math.inf) for t in range(9)]
                    for b in range(4)]
        assert_close(w, expected)
    with pytest.raises(ValueError):
        tis_weights(old, t64(rollout), 0.0)

    for low, high in ((0.5, 2.0), (0.8, 1.25), (1.0, 1.0)):
        kept = icepop_mask(t64(logp), t64(rollout), low, high)
        expected = [[low <= math.exp(logp[b, t] - rollout[b, t]) <= high for t in range(9)] for b in range(4)]
        assert kept.tolist() == expected
        assert kept[0, :3].all()
    assert not icepop_mask(t64(logp), t64(rollout), 0.8, 1.25).all()
    assert icepop_mask(t64(logp), t64(rollout), 1.0, 1.0).sum() == 3
    with pytest.raises(ValueError):
        icepop_mask(t64(logp), t64(rollout), 2.0, 1.0)


def test_masked_mean():
    x = t64([[1.0, 2.0, 100.0], [3.0, math.inf, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert float(masked_mean(x, mask)) == pytest.approx((1 + 2 + 3 + 5) / 4, abs=TOL)
    assert float(masked_mean(x, torch.zeros(2, 3))) == 0.0


# ---------------------------------------------------------------- GSPO ratio

def test_gspo_sequence_ratio_value_and_gradient():
    rng = np.random.default_rng(2)
    batch, length = 5, 7
    logp, old = rng.normal(scale=0.4, size=(batch, length)) - 2.0, rng.normal(scale=0.4, size=(batch, length)) - 2.0
    mask = random_mask(rng, batch, length)
    logp[~mask], old[~mask] = np.inf, np.nan  # padding must not leak into s_i
    lp = t64(logp).requires_grad_(True)
    ratio = gspo_sequence_ratio(lp, t64(old), torch.tensor(mask))

    expected_s = []
    for b in range(batch):
        tokens = [t for t in range(length) if mask[b, t]]
        expected_s.append(math.exp(sum(logp[b, t] - old[b, t] for t in tokens) / len(tokens)) if tokens else 1.0)
    assert_close(ratio, np.repeat(np.array(expected_s)[:, None], length, axis=1))

    # ∂s_i,t/∂logp_t = m_t·s_i, no cross-token gradient: probe with a random cotangent.
    cotangent = rng.normal(size=(batch, length))
    (grad,) = torch.autograd.grad((ratio * t64(cotangent)).sum(), lp, retain_graph=True)
    assert_close(grad, cotangent * mask * np.array(expected_s)[:, None])

    # The sequence mean of the token form has the gradient of the true sequence ratio s_i.
    lengths = mask.sum(axis=1).clip(min=1)
    (grad_mean,) = torch.autograd.grad((ratio * t64(mask) / t64(lengths)[:, None]).sum(), lp)
    lp_direct = t64(logp).requires_grad_(True)
    log_s = torch.where(torch.tensor(mask), lp_direct - t64(old), 0.0).sum(dim=1) / t64(lengths)
    (grad_direct,) = torch.autograd.grad(torch.exp(log_s).sum(), lp_direct)
    assert_close(grad_mean, grad_direct)
    assert_close(grad_mean, mask * np.array(expected_s)[:, None] / lengths[:, None])


# ---------------------------------------------------------------- GRPO token loss

def reference_grpo(logp, old, ref, adv, mask, eps_low, eps_high, kl_beta=0.0, entropy=None, entropy_weight=0.0,
                   rollout=None, tis_truncation=None, icepop=None, ratio_type="token"):
    """Loss, ∂loss/∂logp (GSPO: token form) and flags, token by token with scalar math."""
    batch, length = logp.shape
    loss, grad = np.zeros((batch, length)), np.zeros((batch, length))
    flags = {k: np.zeros((batch, length), dtype=bool) for k in ("clipped_low", "clipped_high", "icepop_kept")}
    for b in range(batch):
        tokens = [t for t in range(length) if mask[b, t]]
        in_band = [t for t in tokens if icepop is None or icepop[0] <= math.exp(old[b, t] - rollout[b, t]) <= icepop[1]]
        seq_ratio = math.exp(sum(logp[b, t] - old[b, t] for t in in_band) / len(in_band)) if in_band else 1.0
        a = float(adv[b])
        for t in tokens:
            r = seq_ratio if ratio_type == "sequence" else math.exp(logp[b, t] - old[b, t])
            clipped_r = min(max(r, 1.0 - eps_low), 1.0 + eps_high)
            surrogate = min(r * a, clipped_r * a)
            high = a > 0 and r > 1.0 + eps_high
            low = a < 0 and r < 1.0 - eps_low
            train_over_rollout = math.exp(old[b, t] - rollout[b, t]) if rollout is not None else 1.0
            w = min(train_over_rollout, tis_truncation) if tis_truncation is not None and rollout is not None else 1.0
            keep = icepop is None or icepop[0] <= train_over_rollout <= icepop[1]
            d_ref = ref[b, t] - logp[b, t]
            value = -w * surrogate + kl_beta * (math.exp(d_ref) - d_ref - 1.0)
            if entropy is not None:
                value -= entropy_weight * entropy[b, t]
            d_value = (0.0 if (high or low) else -w * a * r) + kl_beta * (1.0 - math.exp(d_ref))
            loss[b, t], grad[b, t] = (value, d_value) if keep else (0.0, 0.0)
            flags["clipped_high"][b, t], flags["clipped_low"][b, t], flags["icepop_kept"][b, t] = high, low, keep
    return loss, grad, flags


def as_correction(kwargs):
    """The former tis_truncation / icepop (mask) arguments as a Correction."""
    kwargs = dict(kwargs)
    truncation, band = kwargs.pop("tis_truncation", None), kwargs.pop("icepop", None)
    kwargs["correction"] = Correction(is_level="token" if truncation else None, truncation=truncation,
                                      rejection="token" if band else None, low=band and band[0],
                                      high=band and band[1])
    return kwargs


def find_exact_offset(logp, old, pos, candidates):
    """Set logp[pos] = old[pos] + d for a d whose torch and math exp agree bit for bit; return that ratio."""
    for d in candidates:
        logp[pos] = old[pos] + d
        r_torch = float(torch.exp(t64(logp) - t64(old))[pos])
        if r_torch == math.exp(logp[pos] - old[pos]):
            return r_torch
    raise AssertionError("no candidate offset with an exactly reproducible ratio")


def make_batch(seed, batch=8, length=12, spread=0.35):
    rng = np.random.default_rng(seed)
    old = rng.normal(scale=0.5, size=(batch, length)) - 2.0
    logp = old + rng.normal(scale=spread, size=(batch, length))
    ref = old + rng.normal(scale=0.3, size=(batch, length))
    rollout = old + rng.normal(scale=0.5, size=(batch, length))
    entropy = rng.uniform(0.1, 3.0, size=(batch, length))
    adv = rng.normal(size=batch)
    adv[0], adv[2], adv[3] = 1.0, -1.0, 0.0
    mask = random_mask(rng, batch, length)
    mask[0, :3] = mask[2, :3] = True
    logp[~mask], old[~mask], ref[~mask], rollout[~mask] = np.inf, -np.inf, np.nan, np.inf  # padding garbage
    return rng, logp, old, ref, rollout, entropy, adv, mask


CONFIGS = [
    dict(),
    dict(kl_beta=0.05, entropy_weight=0.01),
    dict(kl_beta=0.1, tis_truncation=1.5, use_rollout=True),
    dict(kl_beta=0.02, entropy_weight=0.003, tis_truncation=2.0, icepop=(0.6, 1.6), use_rollout=True),
    dict(icepop=(0.8, 1.2), use_rollout=True),  # rollout given without truncation: no TIS weight
    dict(ratio_type="sequence"),
    dict(ratio_type="sequence", kl_beta=0.05, entropy_weight=0.01, tis_truncation=1.2, icepop=(0.5, 2.0),
         use_rollout=True),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_grpo_token_loss_matches_reference(config):
    config = dict(config)
    use_rollout = config.pop("use_rollout", False)
    ratio_type = config.get("ratio_type", "token")
    rng, logp, old, ref, rollout, entropy, adv, mask = make_batch(seed=3, spread=0.35 if ratio_type == "token" else 0.5)
    if ratio_type == "token":
        # Ratios exactly on both clip bounds, on tokens whose advantage sign makes that bound the active one.
        upper = find_exact_offset(logp, old, (0, 1), [0.2, 0.21, 0.19, 0.23, 0.17, 0.25])
        lower = find_exact_offset(logp, old, (2, 1), [-0.2, -0.21, -0.19, -0.23, -0.17, -0.25])
        eps_low, eps_high = 1.0 - lower, upper - 1.0
    else:
        eps_low, eps_high = 0.1, 0.15
    kwargs = dict(clamp_eps_lower=eps_low, clamp_eps_upper=eps_high, kl_beta=config.get("kl_beta", 0.0),
                  entropy_weight=config.get("entropy_weight", 0.0), tis_truncation=config.get("tis_truncation"),
                  icepop=config.get("icepop"), ratio_type=ratio_type)
    expected, expected_grad, flags = reference_grpo(
        logp, old, ref, adv, mask, eps_low, eps_high, kwargs["kl_beta"], entropy, kwargs["entropy_weight"],
        rollout if use_rollout else None, kwargs["tis_truncation"], kwargs["icepop"], ratio_type)

    lp = t64(logp).requires_grad_(True)
    loss, stats = grpo_token_loss(lp, t64(old), t64(ref), t64(adv), torch.tensor(mask), entropy=t64(entropy),
                                  rollout_logp=t64(rollout) if use_rollout else None, **as_correction(kwargs))
    assert_close(loss.detach(), expected)
    assert (loss.detach()[~torch.tensor(mask)] == 0).all()
    cotangent = rng.normal(size=logp.shape)
    (grad,) = torch.autograd.grad((loss * t64(cotangent)).sum(), lp)
    assert_close(grad, expected_grad * cotangent)

    for key, ours in (("clipped_low", "clipped_low"), ("clipped_high", "clipped_high"), ("icepop_kept", "kept")):
        expected_flags = flags[key] & flags["icepop_kept"]
        assert stats[ours].dtype == torch.bool and stats[ours].tolist() == expected_flags.tolist(), key
    # Every clip case is exercised: both sides, both signs of the advantage.
    ratio = stats["ratio"].numpy()
    a = np.repeat(adv[:, None], logp.shape[1], axis=1)
    for side in (ratio > 1 + eps_high, ratio < 1 - eps_low):
        for sign in (a > 0, a < 0):
            assert (side & sign & mask).any()
    if kwargs["icepop"] is not None:
        assert not flags["icepop_kept"][mask].all()
    if ratio_type == "token":
        assert ratio[0, 1] == 1 + eps_high and ratio[2, 1] == 1 - eps_low
        assert not flags["clipped_high"][0, 1] and not flags["clipped_low"][2, 1] and expected_grad[0, 1] != 0
    else:
        for b in range(len(adv)):
            assert len(set(ratio[b][mask[b]].tolist())) <= 1  # one ratio per sequence

    valid = mask.astype(bool)
    assert_close(stats["ratio"][torch.tensor(valid)], np.exp(logp - old)[valid] if ratio_type == "token"
                 else ratio[valid])
    kept = flags["icepop_kept"]
    expected_kl = np.where(valid, np.exp(ref - logp) - (ref - logp) - 1.0, 0.0)
    assert_close(stats["kl"][torch.tensor(kept)], expected_kl[kept])
    w = np.minimum(np.exp(old - rollout), kwargs["tis_truncation"]) if use_rollout and kwargs["tis_truncation"] \
        else np.ones_like(old)
    assert_close(stats["is_weight"][torch.tensor(kept)], w[kept])
    assert all(not v.requires_grad for v in stats.values())


@pytest.mark.parametrize("ratio_type", ["token", "sequence"])
def test_grpo_gradient_matches_finite_differences(ratio_type):
    _, logp, old, ref, rollout, entropy, adv, mask = make_batch(seed=4, batch=4, length=6)
    lengths = t64(mask.sum(axis=1).clip(min=1))
    kwargs = dict(clamp_eps_lower=0.2, clamp_eps_upper=0.28, kl_beta=0.07, entropy=t64(entropy),
                  entropy_weight=0.01, ratio_type=ratio_type)
    if ratio_type == "token":
        kwargs.update(rollout_logp=t64(rollout), tis_truncation=1.4, icepop=(0.5, 2.0))
    kwargs = as_correction(kwargs)

    def sequence_mean_loss(lp):
        # GSPO's token form gives the true gradient of the sequence-mean objective (when the per-token
        # weights w and icepop masks are uniform within a sequence: here they are absent).
        loss, _ = grpo_token_loss(lp, t64(old), t64(ref), t64(adv), torch.tensor(mask), **kwargs)
        return loss.sum(dim=1) / lengths

    assert torch.autograd.gradcheck(sequence_mean_loss, (t64(logp).requires_grad_(True),), eps=1e-6, atol=1e-7)


def test_grpo_sign_and_errors():
    logp = t64([[-1.0, -2.0]])
    up = grpo_token_loss(logp + 0.01, logp, logp, t64([1.0]), torch.ones(1, 2), clamp_eps_lower=0.2,
                         clamp_eps_upper=0.2)[0]
    assert (up < 0).all()  # raising the likelihood of a positive-advantage token lowers the loss
    common = dict(clamp_eps_lower=0.2, clamp_eps_upper=0.2)
    for bad in (dict(ratio_type="seq"), dict(correction=Correction(rejection="token", low=0.5, high=2.0)),
                dict(clamp_eps_lower=-0.1, clamp_eps_upper=0.2), dict(clamp_eps_lower=math.nan, clamp_eps_upper=0.2),
                dict(kl_beta=0.1, ref=None), dict(entropy_weight=0.1), dict(dual_clip=1.0)):
        bad = {**common, **bad}
        ref = bad.pop("ref", logp)
        with pytest.raises(ValueError):
            grpo_token_loss(logp, logp, ref, t64([1.0]), torch.ones(1, 2), **bad)


# ---------------------------------------------------------------- reducible diagnostics

def test_mismatch_and_importance_sums():
    rng = np.random.default_rng(5)
    train, rollout = rng.normal(size=(6, 10)) - 2.0, rng.normal(size=(6, 10)) - 2.0
    mask = random_mask(rng, 6, 10)
    sums = mismatch_sums(t64(train), t64(rollout), torch.tensor(mask))
    abs_sum = k3_sum = over = count = 0.0
    for (b, t), valid in np.ndenumerate(mask):
        if valid:
            d = train[b, t] - rollout[b, t]
            abs_sum, k3_sum = abs_sum + abs(d), k3_sum + math.exp(d) - d - 1.0
            over, count = over + (abs(d) > math.log(2)), count + 1
    assert sums.dtype == F64 and sums.shape == (4,)
    assert_close(sums, [abs_sum, k3_sum, over, count])
    metrics = finalize_mismatch(sums)
    assert_close([metrics["mismatch_abs_logp_mean"], metrics["mismatch_k3_kl"], metrics["mismatch_frac_gt_ln2"]],
                 [abs_sum / count, k3_sum / count, over / count])
    assert 0 < over < count
    assert set(finalize_mismatch(mismatch_sums(t64(train), t64(rollout), torch.zeros(6, 10))).values()) == {0.0}

    ratio = np.exp(rng.normal(scale=0.5, size=(6, 10)))
    sums = importance_sums(t64(ratio), torch.tensor(mask))
    weights = [ratio[b, t] for (b, t), valid in np.ndenumerate(mask) if valid]
    assert IMPORTANCE_MAX_ENTRY == 3
    assert_close(sums, [sum(weights), sum(w * w for w in weights), len(weights), max(weights)])
    metrics = finalize_importance(sums)
    assert_close([metrics["ratio_mean"], metrics["ratio_max"], metrics["ess"]],
                 [sum(weights) / len(weights), max(weights),
                  sum(weights) ** 2 / (len(weights) * sum(w * w for w in weights))])
    assert 0 < metrics["ess"] < 1
    # Two ranks: summing the sum entries and max-ing the last equals the single-rank result.
    half = torch.tensor(mask.copy())
    half[3:] = False
    rest = torch.tensor(mask) & ~half
    a, b = importance_sums(t64(ratio), half), importance_sums(t64(ratio), rest)
    reduced = torch.cat([a[:IMPORTANCE_MAX_ENTRY] + b[:IMPORTANCE_MAX_ENTRY], torch.maximum(a[3:], b[3:])])
    assert_close(reduced, sums)
    assert finalize_importance(importance_sums(torch.full((3, 4), 0.7, dtype=F64), torch.ones(3, 4)))["ess"] \
        == pytest.approx(1.0, abs=TOL)
    assert set(finalize_importance(importance_sums(t64(ratio), torch.zeros(6, 10))).values()) == {0.0}


@pytest.mark.parametrize("layers,tokens,k,experts", [(1, 5, 1, 4), (3, 40, 2, 8), (4, 64, 4, 16)])
def test_routing_consistency_against_python_sets(layers, tokens, k, experts):
    rng = np.random.default_rng(layers * 100 + k)
    rollout = np.stack([[rng.choice(experts, size=k, replace=False) for _ in range(tokens)] for _ in range(layers)])
    train = rollout[..., rng.permutation(k)].copy()  # same sets, different order
    for layer in range(layers):
        for n in rng.choice(tokens, size=max(1, tokens // 4), replace=False):
            train[layer, n] = rng.choice(experts, size=k, replace=False)
    mask = rng.random(tokens) < 0.8
    mask[0] = True
    sums = routing_consistency_sums(torch.tensor(rollout), torch.tensor(train), torch.tensor(mask),
                                    num_experts=experts)

    exact, jaccard, any_mismatch = [0.0] * layers, [0.0] * layers, 0.0
    for n in range(tokens):
        if not mask[n]:
            continue
        differs = False
        for layer in range(layers):
            a, b = set(rollout[layer, n].tolist()), set(train[layer, n].tolist())
            exact[layer] += a == b
            jaccard[layer] += len(a & b) / len(a | b)
            differs |= a != b
        any_mismatch += differs
    count = float(mask.sum())
    assert_close(sums["exact"], exact)
    assert_close(sums["jaccard"], jaccard)
    assert float(sums["any_mismatch"]) == any_mismatch and float(sums["tokens"]) == count
    metrics = finalize_routing(sums)
    assert_close(metrics["topk_match"], [e / count for e in exact])
    assert_close(metrics["jaccard"], [j / count for j in jaccard])
    assert_close([metrics["any_layer_mismatch"], metrics["topk_match_mean"], metrics["jaccard_mean"]],
                 [any_mismatch / count, sum(exact) / count / layers, sum(jaccard) / count / layers])
    inferred = routing_consistency_sums(torch.tensor(rollout), torch.tensor(train), torch.tensor(mask))
    assert all(torch.equal(inferred[key], sums[key]) for key in sums)
    same = finalize_routing(routing_consistency_sums(torch.tensor(rollout), torch.tensor(rollout[..., ::-1].copy()),
                                                     torch.tensor(mask)))
    assert same["topk_match"] == [1.0] * layers and same["any_layer_mismatch"] == 0.0


def test_load_drift_total_variation():
    rng = np.random.default_rng(6)
    load, first = rng.integers(0, 50, size=(4, 8)), rng.integers(0, 50, size=(4, 8))
    load[2] = 0
    first[3] = 3 * load[3]  # same distribution, different token count
    expected = []
    for layer in range(4):
        p_total, q_total = load[layer].sum(), first[layer].sum()
        if p_total == 0 or q_total == 0:
            expected.append(0.0)
            continue
        expected.append(0.5 * sum(abs(p / p_total - q / q_total) for p, q in zip(load[layer], first[layer])))
    drift = load_drift(torch.tensor(load), torch.tensor(first))
    assert drift.dtype == F64
    assert_close(drift, expected)
    assert drift[2] == 0 and abs(float(drift[3])) < TOL and 0 < float(drift[0]) <= 1
