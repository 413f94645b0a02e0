"""The one definition of loss divergence used by `report` and `compare`.

A run diverges at the first step `s` (after `warmup` steps of the run) where any of:
  1. the loss is non-finite (NaN/inf; counted from step 1, no warm-up needed);
  2. L[s] > loss_factor × min(L[..s-1])  (the running minimum so far), where L is the loss averaged over
     the last `loss_window` steps (1 = the per-step loss; a window keeps small-batch noise from counting);
  3. grad_norm[s] > grad_factor × median(grad_norm[1..s-1])  (the running median so far).
Skipped steps keep their recorded values. Parameters live in DivergenceRule and are written into outputs.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class DivergenceRule:
    """Parameters of the divergence definition (see the module docstring)."""

    warmup: int = 10
    loss_factor: float = 1.5
    grad_factor: float = 10.0
    loss_window: int = 1

    def as_dict(self) -> dict:
        """The parameters, for summary outputs."""
        return {**asdict(self), "definition": DEFINITION}


DEFINITION = ("first step with non-finite loss, or (after `warmup` steps) loss (mean of the last `loss_window` "
              "steps) > loss_factor x its running minimum over earlier steps, or grad norm > grad_factor x running "
              "median of earlier grad norms")


def divergence_step(steps, loss, grad_norm, rule: DivergenceRule = DivergenceRule()) -> tuple[int | None, str]:
    """(first diverging step, reason) under `rule`, or (None, "no divergence")."""
    run_min = math.inf
    grads: list[float] = []
    w = max(1, rule.loss_window)
    what = "loss" if w == 1 else f"mean loss of the last {w} steps"
    for i, (step, lv, gv) in enumerate(zip(steps, loss, grad_norm)):
        if not math.isfinite(lv):
            return step, "non-finite loss"
        lv = statistics.fmean(loss[max(0, i - w + 1):i + 1])
        if i >= rule.warmup:
            if lv > rule.loss_factor * run_min:
                return step, f"{what} {lv:.4g} > {rule.loss_factor} x running min {run_min:.4g}"
            if grads and math.isfinite(gv) and gv > rule.grad_factor * statistics.median(grads):
                return step, f"grad norm {gv:.4g} > {rule.grad_factor} x running median {statistics.median(grads):.4g}"
        if i >= w - 1:  # only full windows set the minimum
            run_min = min(run_min, lv)
        if math.isfinite(gv):
            grads.append(gv)
    return None, "no divergence"
