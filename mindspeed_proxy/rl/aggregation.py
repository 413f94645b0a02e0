"""Loss aggregation: the per-token GRPO loss reduced to the optimizer step's objective, layout-independent.

Every mode is a weighted sum L = Σ_{i,t} c_i,t · ℓ_i,t over the kept tokens of the step's *global* batch
(all data-parallel ranks, all micro-batches), with coefficients that depend only on the masks and on
global counts (one all-reduce before the step), so the objective and its gradient do not depend on the
DP / EP layout or on micro-batching:
- "token-mean": c = 1 / N_tok (N_tok: kept tokens of the global batch);
- "seq-mean-token-mean": c = 1 / (|y_i| · N_seq) (|y_i|: kept tokens of sequence i; N_seq: sequences
  with at least one kept token); the GSPO objective (1/N_seq) Σ_i S_i is this mode over its token form;
- "seq-mean-token-sum": c = 1 / N_seq;
- "seq-mean-token-sum-norm" (Dr.GRPO): c = 1 / (N_rows · T), a constant: N_rows the rows of the global
  batch, T the response length budget; no length bias.
Torch only.
"""
from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
GSPO_AGGREGATION = "seq-mean-token-mean"


def check(mode: str, ratio_type: str = "token") -> None:
    """Refuse an unknown mode, and a mode that breaks GSPO's per-sequence objective."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, got {mode!r}")
    if ratio_type == "sequence" and mode != GSPO_AGGREGATION:
        raise ValueError(f"the GSPO sequence ratio needs the per-sequence objective ({GSPO_AGGREGATION}); "
                         f"{mode} weights sequences by their length")


@torch.no_grad()
def local_counts(kept: torch.Tensor) -> torch.Tensor:
    """float64 [kept tokens, sequences with a kept token, rows] of this rank's share (SUM-reduce over DP)."""
    kept = kept.bool()
    return torch.tensor([float(kept.sum()), float(kept.any(dim=1).sum()), float(kept.shape[0])],
                        dtype=torch.float64)


@torch.no_grad()
def coefficients(kept: torch.Tensor, mode: str, counts: torch.Tensor, max_length: int) -> torch.Tensor:
    """c [B, T] (float64, 0 outside `kept`) of `mode` given the global `counts` from `local_counts`."""
    check(mode)
    kept = kept.bool()
    tokens, sequences, rows = (float(v) for v in counts)
    ones = kept.to(torch.float64)
    if mode == "token-mean":
        return ones / max(tokens, 1.0)
    if mode == "seq-mean-token-mean":
        lengths = ones.sum(dim=1, keepdim=True).clamp(min=1.0)
        return ones / lengths / max(sequences, 1.0)
    if mode == "seq-mean-token-sum":
        return ones / max(sequences, 1.0)
    return ones / (max(rows, 1.0) * max_length)


def aggregate(token_loss: torch.Tensor, kept: torch.Tensor, mode: str, max_length: int | None = None) -> torch.Tensor:
    """The objective of one whole batch (all its rows are the global batch): Σ c · ℓ."""
    c = coefficients(kept, mode, local_counts(kept), max_length or kept.shape[1])
    return (token_loss * c.to(token_loss.dtype)).sum()
