"""Rollout-vs-training diagnostics as reducible sums: logprob mismatch, importance weights, routing agreement.

Each `*_sums` function returns float64 sums and counts that add up over data-parallel ranks (one
all-reduce); the matching `finalize_*` turns the reduced values into metrics. Torch only.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from mindspeed_proxy.rl.losses import k3_kl

# importance_sums layout: entries [0, IMPORTANCE_MAX_ENTRY) are SUM-reduced, the last one MAX-reduced.
IMPORTANCE_MAX_ENTRY = 3


def _valid_values(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float64)[mask.bool()]


@torch.no_grad()
def mismatch_sums(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 [Σ|Δ|, Σ k3, #(|Δ| > ln 2), #tokens] over valid tokens, Δ = train − rollout logprob.

    k3 estimates KL(π_rollout ‖ π_train) on the rollout's own samples: exp(Δ) − Δ − 1, i.e.
    `k3_kl(rollout, train)`. All four entries are SUM-reduced.
    """
    train = _valid_values(train_logp, mask)
    rollout = _valid_values(rollout_logp, mask)
    delta = (train - rollout).abs()
    return torch.stack([
        delta.sum(),
        k3_kl(rollout, train).sum(),
        (delta > math.log(2.0)).sum().to(torch.float64),
        torch.tensor(float(delta.numel()), dtype=torch.float64, device=delta.device),
    ])


def finalize_mismatch(sums: torch.Tensor) -> dict[str, float]:
    """Mean |Δ logprob|, mean k3 KL(rollout ‖ train) and the fraction of tokens with |Δ| > ln 2 (0 if empty)."""
    abs_sum, k3_sum, over_ln2, tokens = (float(v) for v in sums)
    if tokens <= 0:
        return {"mismatch_abs_logp_mean": 0.0, "mismatch_k3_kl": 0.0, "mismatch_frac_gt_ln2": 0.0}
    return {
        "mismatch_abs_logp_mean": abs_sum / tokens,
        "mismatch_k3_kl": k3_sum / tokens,
        "mismatch_frac_gt_ln2": over_ln2 / tokens,
    }


@torch.no_grad()
def importance_sums(ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 [Σw, Σw², #tokens, max w] of the importance weights `ratio` at valid tokens.

    The first three entries are SUM-reduced, the last (index IMPORTANCE_MAX_ENTRY) MAX-reduced;
    weights are nonnegative, so the max of no token is 0.
    """
    w = _valid_values(ratio, mask)
    max_w = w.max() if w.numel() else torch.zeros((), dtype=torch.float64, device=w.device)
    return torch.stack([
        w.sum(),
        w.square().sum(),
        torch.tensor(float(w.numel()), dtype=torch.float64, device=w.device),
        max_w,
    ])


def finalize_importance(sums: torch.Tensor) -> dict[str, float]:
    """Mean and max weight and normalised ESS (Σw)² / (n·Σw²) in (0, 1] (all 0 when there is no token).

    The RL loop passes the weights the loss applies (after truncation and rejection), or the log-clamped
    train/rollout ratio where no IS weight is applied."""
    w_sum, w_sq_sum, tokens, w_max = (float(v) for v in sums)
    if tokens <= 0:
        return {"ratio_mean": 0.0, "ratio_max": 0.0, "ess": 0.0}
    return {
        "ratio_mean": w_sum / tokens,
        "ratio_max": w_max,
        "ess": w_sum * w_sum / (tokens * w_sq_sum) if w_sq_sum > 0 else 0.0,
    }


@torch.no_grad()
def rejection_sums(kept: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 [rejected tokens, valid tokens, rejected sequences, sequences with a valid token] (SUM-reduced).

    A token is rejected when it is valid in `mask` and not in `kept`; a sequence when it has valid tokens
    and none is kept."""
    valid, kept = mask.bool(), kept.bool() & mask.bool()
    rows = valid.any(dim=1)
    return torch.tensor([float((valid & ~kept).sum()), float(valid.sum()), float((rows & ~kept.any(dim=1)).sum()),
                         float(rows.sum())], dtype=torch.float64)


def finalize_rejection(sums: torch.Tensor) -> dict[str, float]:
    """Fractions of the valid tokens and of the sequences that the rejection left out of the loss."""
    tokens_out, tokens, rows_out, rows = (float(v) for v in sums)
    return {"rejected_token_frac": tokens_out / tokens if tokens else 0.0,
            "rejected_seq_frac": rows_out / rows if rows else 0.0}


def _expert_sets(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    sets = torch.zeros(*idx.shape[:-1], num_experts, dtype=torch.bool, device=idx.device)
    return sets.scatter_(-1, idx.long(), True)


@torch.no_grad()
def routing_consistency_sums(rollout_idx: torch.Tensor, train_idx: torch.Tensor, mask: torch.Tensor, *,
                             num_experts: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Agreement of the top-k expert sets [L, N, k] of rollout and training over the tokens in `mask` [N].

    Order within k is ignored. Returns float64 sums (all SUM-reduced): "exact" [L] (#tokens whose sets
    are equal), "jaccard" [L] (Σ |A∩B| / |A∪B|), "any_mismatch" (#tokens whose sets differ in at least
    one layer) and "tokens". `num_experts` defaults to the largest id + 1.
    """
    if rollout_idx.dim() != 3 or train_idx.shape[:2] != rollout_idx.shape[:2]:
        raise ValueError(f"expected [L, N, k] expert ids with equal L, N, got {tuple(rollout_idx.shape)} "
                         f"and {tuple(train_idx.shape)}")
    if num_experts is None:
        num_experts = int(max(rollout_idx.max(), train_idx.max())) + 1 if rollout_idx.numel() else 1
    rollout_sets = _expert_sets(rollout_idx, num_experts)
    train_sets = _expert_sets(train_idx, num_experts)
    intersection = (rollout_sets & train_sets).sum(dim=-1).to(torch.float64)
    union = (rollout_sets | train_sets).sum(dim=-1).to(torch.float64)
    jaccard = torch.where(union > 0, intersection / union.clamp(min=1), torch.ones_like(union))
    equal = (rollout_sets == train_sets).all(dim=-1)
    counted = mask.bool().to(equal.device)
    weight = counted.to(torch.float64)
    return {
        "exact": (equal.to(torch.float64) * weight).sum(dim=1),
        "jaccard": (jaccard * weight).sum(dim=1),
        "any_mismatch": ((~equal).any(dim=0) & counted).sum().to(torch.float64),
        "tokens": weight.sum(),
    }


def finalize_routing(sums: dict[str, torch.Tensor]) -> dict[str, object]:
    """Per-layer top-k set match rate and Jaccard, their layer means and the any-layer mismatch fraction."""
    tokens = float(sums["tokens"])

    def rate(count) -> float:
        return float(count) / tokens if tokens > 0 else 0.0

    topk_match = [rate(v) for v in sums["exact"]]
    jaccard = [rate(v) for v in sums["jaccard"]]
    return {
        "topk_match": topk_match,
        "jaccard": jaccard,
        "any_layer_mismatch": rate(sums["any_mismatch"]),
        "topk_match_mean": sum(topk_match) / len(topk_match) if topk_match else 0.0,
        "jaccard_mean": sum(jaccard) / len(jaccard) if jaccard else 0.0,
    }


@torch.no_grad()
def load_drift(load: torch.Tensor, first_load: torch.Tensor) -> torch.Tensor:
    """Per-layer total variation 0.5·Σ_e |p − q| of the normalised expert loads [L, E] (0 for an empty layer)."""
    p, q = load.to(torch.float64), first_load.to(torch.float64)
    p_total, q_total = p.sum(dim=-1, keepdim=True), q.sum(dim=-1, keepdim=True)
    p = p / torch.where(p_total > 0, p_total, torch.ones_like(p_total))
    q = q / torch.where(q_total > 0, q_total, torch.ones_like(q_total))
    drift = 0.5 * (p - q).abs().sum(dim=-1)
    empty = (p_total <= 0) | (q_total <= 0)
    return torch.where(empty.squeeze(-1), torch.zeros_like(drift), drift)


def expert_load(routing: torch.Tensor, mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[L, E] token counts of the routing [L, N, k] at the tokens in mask [N]."""
    picked = routing[:, mask].reshape(routing.shape[0], -1).long()
    load = torch.zeros(routing.shape[0], num_experts, dtype=torch.float64)
    return load.scatter_add_(1, picked, torch.ones_like(picked, dtype=torch.float64))


def duplicate_share(groups) -> Optional[float]:
    """Share of the samples that repeat an earlier sample of their group (`groups`: lists of hashable samples);
    None for no samples. Identical samples of one prompt carry no extra GRPO signal."""
    total = repeats = 0
    for group in groups:
        seen: set = set()
        for sample in group:
            total += 1
            repeats += sample in seen
            seen.add(sample)
    return repeats / total if total else None
