"""Train/rollout importance-sampling corrections as one family: IS weights, truncation, rejection, IcePop.

k_t = π_old(y_t) / π_rollout(y_t) = exp(old − rollout) is the per-token train/rollout ratio (its log is
clamped to ±LOG_RATIO_CLAMP first, so no finite pair gives inf). A `Correction` says
- the IS weight's level: none, "token" (k_t; Megatron-LM's `--rl-inference-logprobs-is-correction`),
  "sequence" (Π_t k_t over the sequence's valid tokens) or "geometric" (exp(mean_t log k_t)); the
  sequence levels give every token of a sequence the same weight;
- `truncation`: the weight becomes min(w, truncation) (TIS); None leaves it untruncated;
- rejection: tokens ("token") or whole sequences ("sequence" / "geometric", by that level's weight) whose
  ratio lies outside [low, high] leave the loss and its denominator.
IcePop as published (Ling team; slime, verl) is token rejection with the band [low, high] plus the token
weight k_t on the kept tokens; its mask-only variant is token rejection without a weight.
Torch only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

LEVELS = ("token", "sequence", "geometric")
LOG_RATIO_CLAMP = 20.0  # |log ratio| bound before exp: e^20 and its products with O(1) terms stay finite in fp32


@dataclass(frozen=True)
class Correction:
    """One member of the correction family (see the module docstring); the default corrects nothing."""

    is_level: Optional[str] = None
    truncation: Optional[float] = None
    rejection: Optional[str] = None
    low: Optional[float] = None
    high: Optional[float] = None

    def __post_init__(self):
        for name in ("is_level", "rejection"):
            value = getattr(self, name)
            if value is not None and value not in LEVELS:
                raise ValueError(f"{name} must be one of {LEVELS} or None, got {value!r}")
        if self.truncation is not None and not self.truncation > 0:
            raise ValueError(f"truncation must be > 0, got {self.truncation}")
        if self.rejection is not None:
            if self.low is None or self.high is None or not 0 <= self.low <= self.high:
                raise ValueError(f"rejection band must satisfy 0 <= low <= high, got ({self.low}, {self.high})")
        if self.truncation is not None and self.is_level is None:
            raise ValueError("truncation needs an IS level")

    @property
    def active(self) -> bool:
        """True when the correction needs the rollout logprobs."""
        return self.is_level is not None or self.rejection is not None


def icepop(low: float, high: float, weighted: bool = True) -> Correction:
    """IcePop: tokens with k_t outside [low, high] rejected; kept tokens weighted by k_t unless mask-only."""
    return Correction(is_level="token" if weighted else None, rejection="token", low=low, high=high)


def log_token_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log k_t = clamp(old − rollout, ±LOG_RATIO_CLAMP) at valid tokens, 0 elsewhere (detached)."""
    delta = torch.where(valid, old_logp.detach() - rollout_logp.detach(), torch.zeros_like(old_logp))
    return delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def level_weight(log_k: torch.Tensor, valid: torch.Tensor, level: str) -> torch.Tensor:
    """The ratio at `level`, broadcast to [B, T]: k_t, Π_t k_t or exp(mean_t log k_t) over valid tokens."""
    if level == "token":
        return torch.exp(log_k)
    total = log_k.sum(dim=1, keepdim=True)
    if level == "geometric":
        total = total / valid.sum(dim=1, keepdim=True).clamp(min=1).to(log_k.dtype)
    return torch.exp(total.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).expand_as(log_k)


@torch.no_grad()
def rollout_correction(old_logp: torch.Tensor, rollout_logp: Optional[torch.Tensor], mask: torch.Tensor,
                       correction: Correction) -> tuple[torch.Tensor, torch.Tensor]:
    """(IS weight w [B, T], kept [B, T] bool): the weight each token's policy term carries and the tokens left
    in the loss after rejection (valid tokens only; w is 1 where no weight applies, 0 outside `kept`)."""
    valid = mask.bool()
    if not correction.active:
        return valid.to(old_logp.dtype), valid
    if rollout_logp is None:
        raise ValueError("an importance-sampling correction needs the rollout logprobs")
    log_k = log_token_ratio(old_logp, rollout_logp, valid)
    kept = valid
    if correction.rejection is not None:
        ratio = level_weight(log_k, valid, correction.rejection)
        kept = valid & (ratio >= correction.low) & (ratio <= correction.high)
    weight = torch.ones_like(log_k)
    if correction.is_level is not None:
        weight = level_weight(log_k, valid, correction.is_level)
        if correction.truncation is not None:
            weight = weight.clamp(max=correction.truncation)
    return torch.where(kept, weight, torch.zeros_like(weight)), kept


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
