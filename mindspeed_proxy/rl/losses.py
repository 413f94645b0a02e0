"""GRPO per-token loss: group advantages, clipped (and dual-clipped) ratio, KL estimators, GSPO ratio.

Shapes: B sequences, T response positions; logprobs are [B, T]; `mask` [B, T] marks the valid response
tokens and is read as a boolean (nonzero = valid). Names follow Megatron-LM's `calculate_grpo_loss`
(megatron/rl/rl_utils.py): `clamp_eps_lower` / `clamp_eps_upper`, `kl_beta`, `entropy_weight`. The
train/rollout corrections (IS weights, IcePop, rejection) come from `correction.py`; the reduction of the
per-token loss to the step's objective from `aggregation.py`. Torch only, no Megatron import.
"""
from __future__ import annotations

from typing import Optional

import torch

from mindspeed_proxy.rl.correction import (  # noqa: F401  (tis_weights, icepop_mask: re-exported)
    LOG_RATIO_CLAMP, Correction, icepop_mask, rollout_correction, tis_weights)

RATIO_TYPES = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")


def group_advantages(rewards: torch.Tensor, group_size: int,
                     eps: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages (r − group mean) / (population group std + eps) and the per-group `std > 0` flags.

    `rewards` [N] are group-major: group g is rows g·G .. g·G + G − 1. The statistics are computed in
    float64; the advantages come back in the input dtype promoted to at least float32. A group is
    nonzero when its rewards are not all equal (max != min, an exact test, so rounding in the mean
    cannot turn a constant group into a nonzero one); a constant group gets advantage exactly 0.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size={group_size}, "
                         f"got shape {tuple(rewards.shape)}")
    out_dtype = torch.promote_types(rewards.dtype, torch.float32)
    grouped = rewards.detach().to(torch.float64).view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, correction=0, keepdim=True)
    nonzero = grouped.amax(dim=1) != grouped.amin(dim=1)
    advantages = torch.where(nonzero.unsqueeze(1), (grouped - mean) / (std + eps), torch.zeros_like(grouped))
    return advantages.reshape(-1).to(out_dtype), nonzero


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π ‖ π_ref) on samples of π: exp(ref − logp) − (ref − logp) − 1 ≥ 0."""
    log_ratio = ref_logp - logp
    return torch.expm1(log_ratio) - log_ratio


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) on samples of π: k1 = logp − ref, k2 = ½(logp − ref)², k3 (`k3_kl`)."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k2":
        return 0.5 * (logp - ref_logp).square()
    if estimator == "k3":
        return k3_kl(logp, ref_logp)
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def _zero_outside(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # Padding positions may hold anything (even ±inf); zeroing them keeps values and gradients finite.
    return torch.where(valid, x, torch.zeros_like(x))


def gspo_sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO ratio in token form: s_i,t = sg(s_i) · exp(logp_t − sg(logp_t)) at the tokens of `mask`, [B, T].

    s_i = exp(Σ_t m_t·(logp_t − old_t) / Σ_t m_t) is the length-normalised sequence ratio (1 for a row
    without tokens; the mean log-ratio is clamped to ±LOG_RATIO_CLAMP). The value of s_i,t is s_i at every
    position; its gradient is ∂s_i,t/∂logp_t = m_t·s_i and zero w.r.t. every other token, so the
    per-sequence token mean (1/|y_i|)·Σ_t m_t·s_i,t has the true gradient of s_i:
    ∂s_i/∂logp_t = m_t·s_i/|y_i| (inside the clamp).
    """
    valid = mask.bool()
    logp = _zero_outside(logp, valid)
    log_ratio = _zero_outside(logp.detach() - old_logp.detach(), valid)
    lengths = valid.sum(dim=1, keepdim=True).clamp(min=1).to(logp.dtype)
    mean_log = (log_ratio.sum(dim=1, keepdim=True) / lengths).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(mean_log) * torch.exp(logp - logp.detach())


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over the valid positions of `mask` (a scalar; 0 when no position is valid)."""
    valid = mask.bool()
    total = torch.where(valid, x, torch.zeros_like(x)).sum()
    return total / valid.sum().clamp(min=1).to(total.dtype)


def grpo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: Optional[torch.Tensor],
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clamp_eps_lower: float,
    clamp_eps_upper: float,
    kl_beta: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Optional[torch.Tensor] = None,
    entropy_weight: float = 0.0,
    rollout_logp: Optional[torch.Tensor] = None,
    correction: Optional[Correction] = None,
    ratio_type: str = "token",
    dual_clip: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GRPO loss [B, T] (zero outside the kept tokens) and detached per-token diagnostics.

    loss = kept · (−w · S + kl_beta · KL(logp, ref) − entropy_weight · entropy)
    S = min(r·A, clip(r, 1 − eps_lower, 1 + eps_upper)·A), and with `dual_clip` C (> 1) and A < 0,
    S = max(that, C·A) (verl's dual-clip: a negative-advantage token with r > C contributes the constant
    −C·A). r = exp(clamp(logp − old, ±LOG_RATIO_CLAMP)) (ratio_type "token") or the GSPO token-form ratio
    over the kept tokens (ratio_type "sequence", see `gspo_sequence_ratio`); A = advantages [B] broadcast
    over tokens; (w, kept) = `rollout_correction(old, rollout, mask, correction)` (w = 1 and kept = mask
    without a correction). KL is `kl_estimate(logp, ref, kl_estimator)`; `entropy` [B, T] is the policy
    entropy per position. The clipped branch is active only when r > 1 + eps_upper with A > 0 or
    r < 1 − eps_lower with A < 0, the dual branch when r > C with A < 0; a ratio exactly on a bound counts
    as unclipped and keeps its gradient. The caller aggregates (`aggregation.py`). Masked positions may hold
    any value, ±inf included: they are replaced by 0 before any arithmetic.

    Diagnostics (all [B, T], detached, bool ones False outside kept): "ratio", "clipped_low",
    "clipped_high", "clipped_dual", "kl" (zeros when ref_logp is None), "is_weight" (w), "kept".
    """
    if ratio_type not in RATIO_TYPES:
        raise ValueError(f"ratio_type must be one of {RATIO_TYPES}, got {ratio_type!r}")
    if not (clamp_eps_lower >= 0 and clamp_eps_upper >= 0):
        raise ValueError(f"clamp eps must be >= 0, got lower={clamp_eps_lower}, upper={clamp_eps_upper}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if kl_beta != 0 and ref_logp is None:
        raise ValueError("kl_beta != 0 needs ref_logp")
    if entropy_weight != 0 and entropy is None:
        raise ValueError("entropy_weight != 0 needs entropy")
    correction = correction or Correction()

    valid = mask.bool()
    logp = _zero_outside(logp, valid)
    old_logp = _zero_outside(old_logp.detach(), valid)
    rollout = None if rollout_logp is None else _zero_outside(rollout_logp.detach(), valid)
    is_weight, kept = rollout_correction(old_logp, rollout, valid, correction)
    if ratio_type == "token":
        ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    else:
        ratio = gspo_sequence_ratio(logp, old_logp, kept)
    adv = advantages.detach().to(logp.dtype).view(-1, 1).expand_as(logp)
    lower, upper = 1.0 - clamp_eps_lower, 1.0 + clamp_eps_upper
    r = ratio.detach()
    clipped_high = (r > upper) & (adv > 0) & kept
    clipped_low = (r < lower) & (adv < 0) & kept
    clipped_dual = (r > dual_clip) & (adv < 0) & kept if dual_clip is not None else torch.zeros_like(kept)
    # min(r·A, clip(r)·A) picks the clipped (constant) branch exactly where one of the flags is set.
    surrogate = torch.where(clipped_high | clipped_low, r.clamp(lower, upper), ratio) * adv
    if dual_clip is not None:
        surrogate = torch.where(clipped_dual, dual_clip * adv, surrogate)
    loss = -is_weight * surrogate

    kl = torch.zeros_like(r)
    if ref_logp is not None:
        kl_term = kl_estimate(logp, _zero_outside(ref_logp.detach(), valid), kl_estimator)
        kl = _zero_outside(kl_term.detach(), kept)
        if kl_beta != 0:
            loss = loss + kl_beta * kl_term
    if entropy is not None and entropy_weight != 0:
        loss = loss - entropy_weight * _zero_outside(entropy, valid)

    loss = torch.where(kept, loss, torch.zeros_like(loss))
    stats = {"ratio": r, "clipped_low": clipped_low, "clipped_high": clipped_high, "clipped_dual": clipped_dual,
             "kl": kl, "is_weight": is_weight, "kept": kept}
    return loss, stats
