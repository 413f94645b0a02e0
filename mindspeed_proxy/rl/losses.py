"""GRPO loss math: group advantages, clipped policy ratio, k3 KL, TIS / IcePop rollout corrections, GSPO ratio.

Shapes: B sequences, T response positions; logprobs are [B, T]; `mask` [B, T] marks the valid response
tokens and is read as a boolean (nonzero = valid). Names follow Megatron-LM's `calculate_grpo_loss`
(megatron/rl/rl_utils.py): `clamp_eps_lower` / `clamp_eps_upper`, `kl_beta`, `entropy_weight`, and the
token TIS weight exp(old − rollout) truncated at `--rl-importance-sampling-truncation-coef`.
Torch only, no Megatron import.
"""
from __future__ import annotations

from typing import Optional

import torch

RATIO_TYPES = ("token", "sequence")


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


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                truncation: Optional[float]) -> torch.Tensor:
    """Token truncated-importance-sampling weight min(exp(old − rollout), truncation), detached."""
    weights = torch.exp(old_logp.detach() - rollout_logp.detach())
    if truncation is not None:
        if truncation <= 0:
            raise ValueError(f"truncation must be > 0, got {truncation}")
        weights = weights.clamp(max=truncation)
    return weights


def icepop_mask(old_logp: torch.Tensor, rollout_logp: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """IcePop keep-mask: True where the train/rollout ratio exp(old − rollout) lies in [low, high]."""
    if not 0 <= low <= high:
        raise ValueError(f"icepop band must satisfy 0 <= low <= high, got ({low}, {high})")
    ratio = torch.exp(old_logp.detach() - rollout_logp.detach())
    return (ratio >= low) & (ratio <= high)


def _zero_outside(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # Padding positions may hold anything (even ±inf); zeroing them keeps values and gradients finite.
    return torch.where(valid, x, torch.zeros_like(x))


def gspo_sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO ratio in token form: s_i,t = sg(s_i) · exp(logp_t − sg(logp_t)) at valid tokens, [B, T].

    s_i = exp(Σ_t m_t·(logp_t − old_t) / Σ_t m_t) is the length-normalised sequence ratio (1 for a row
    without valid tokens). The value of s_i,t is s_i at every position; its gradient is
    ∂s_i,t/∂logp_t = m_t·s_i and zero w.r.t. every other token (masked positions carry no gradient), so
    the sequence-mean objective (1/|y_i|)·Σ_t m_t·s_i,t has the true gradient of s_i:
    ∂s_i/∂logp_t = m_t·s_i/|y_i|.
    """
    valid = mask.bool()
    logp = _zero_outside(logp, valid)
    log_ratio = _zero_outside(logp.detach() - old_logp.detach(), valid)
    lengths = valid.sum(dim=1, keepdim=True).clamp(min=1).to(logp.dtype)
    sequence_ratio = torch.exp(log_ratio.sum(dim=1, keepdim=True) / lengths)
    return sequence_ratio * torch.exp(logp - logp.detach())


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
    entropy: Optional[torch.Tensor] = None,
    entropy_weight: float = 0.0,
    rollout_logp: Optional[torch.Tensor] = None,
    tis_truncation: Optional[float] = None,
    icepop: Optional[tuple[float, float]] = None,
    ratio_type: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GRPO loss [B, T] (zero at masked positions) and detached per-token diagnostics.

    loss = keep · mask · (−w · min(r·A, clip(r, 1 − eps_lower, 1 + eps_upper)·A)
                          + kl_beta · k3(logp, ref) − entropy_weight · entropy)
    r = exp(logp − old) (ratio_type "token") or the GSPO token-form ratio (ratio_type "sequence", see
    `gspo_sequence_ratio`); A = advantages [B] broadcast over tokens; w = `tis_weights(old, rollout,
    tis_truncation)` when both `rollout_logp` and `tis_truncation` are given, else 1; keep = `icepop_mask`
    when `icepop` = (low, high) is given (requires `rollout_logp`), else 1. `entropy` [B, T] is the policy
    entropy of the full distribution per position. The clipped branch of the min is active only when
    r > 1 + eps_upper with A > 0 or r < 1 − eps_lower with A < 0; a ratio exactly on a bound counts as
    unclipped and keeps its gradient. With ratio_type "sequence" w and keep still act token by token.
    The caller chooses the aggregation (token mean, sequence mean, ...). Masked positions may hold any
    value, ±inf included: they are replaced by 0 before any arithmetic.

    Diagnostics (all [B, T], detached, bool ones False at masked positions): "ratio", "clipped_low",
    "clipped_high" (the clipped branch is active, low / high side), "kl" (k3; zeros when ref_logp is
    None), "is_weight" (w), "icepop_kept".
    """
    if ratio_type not in RATIO_TYPES:
        raise ValueError(f"ratio_type must be one of {RATIO_TYPES}, got {ratio_type!r}")
    if clamp_eps_lower < 0 or clamp_eps_upper < 0:
        raise ValueError(f"clamp eps must be >= 0, got lower={clamp_eps_lower}, upper={clamp_eps_upper}")
    if icepop is not None and rollout_logp is None:
        raise ValueError("icepop needs rollout_logp")
    if kl_beta != 0 and ref_logp is None:
        raise ValueError("kl_beta != 0 needs ref_logp")
    if entropy_weight != 0 and entropy is None:
        raise ValueError("entropy_weight != 0 needs entropy")

    valid = mask.bool()
    logp = _zero_outside(logp, valid)
    old_logp = _zero_outside(old_logp.detach(), valid)
    if rollout_logp is not None:
        rollout_logp = _zero_outside(rollout_logp.detach(), valid)
    kept = valid if icepop is None else icepop_mask(old_logp, rollout_logp, *icepop) & valid
    if ratio_type == "token":
        ratio = torch.exp(logp - old_logp)
    else:
        ratio = gspo_sequence_ratio(logp, old_logp, valid)
    adv = advantages.detach().to(logp.dtype).view(-1, 1).expand_as(logp)
    lower, upper = 1.0 - clamp_eps_lower, 1.0 + clamp_eps_upper
    clipped_high = (ratio.detach() > upper) & (adv > 0) & valid
    clipped_low = (ratio.detach() < lower) & (adv < 0) & valid
    # min(r·A, clip(r)·A) picks the clipped (constant) branch exactly where one of the flags is set.
    surrogate = torch.where(clipped_high | clipped_low, ratio.detach().clamp(lower, upper), ratio) * adv

    is_weight = torch.ones_like(ratio.detach())
    if rollout_logp is not None and tis_truncation is not None:
        is_weight = tis_weights(old_logp, rollout_logp, tis_truncation)
    loss = -is_weight * surrogate

    kl = torch.zeros_like(is_weight)
    if ref_logp is not None:
        kl_term = k3_kl(logp, _zero_outside(ref_logp.detach(), valid))
        kl = kl_term.detach()
        if kl_beta != 0:
            loss = loss + kl_beta * kl_term
    if entropy is not None and entropy_weight != 0:
        loss = loss - entropy_weight * _zero_outside(entropy, valid)

    loss = torch.where(kept, loss, torch.zeros_like(loss))

    stats = {
        "ratio": ratio.detach(),
        "clipped_low": clipped_low,
        "clipped_high": clipped_high,
        "kl": kl,
        "is_weight": is_weight,
        "icepop_kept": kept,
    }
    return loss, stats
