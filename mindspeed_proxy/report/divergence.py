"""The one definition of loss divergence used by `report` and `compare`.

After `warmup` steps of the run:
  a. the loss rises: L[s] > loss_factor × min(L[..s-1])  (the running minimum so far), where L is the loss
     averaged over the last `loss_window` steps (1 = the per-step loss; a window keeps small-batch noise
     from counting);
  b. the gradient spikes: grad_norm[s] > grad_factor × median(grad_norm[1..s-1])  (the running median so far).
The run diverges at the first step `s` that starts `persistence` consecutive steps of (a) (a rise that stays:
one noisy small-batch step is not a divergence), at the first step of (b), or at the first non-finite loss
(NaN/inf, counted from step 1); a spike or a non-finite loss during a rise dates the divergence to the
rise's first step. A rise that runs into the end of the run before `persistence` steps of it are counted
cannot be judged: the run is not called diverged and the reason names those steps as undecided. Skipped
steps keep their recorded values. Parameters live in DivergenceRule and are written into outputs.
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
    persistence: int = 3

    def __post_init__(self):
        if self.persistence < 1 or self.loss_window < 1 or self.warmup < 0:
            raise ValueError(f"DivergenceRule: persistence and loss_window must be >= 1 and warmup >= 0, got {self}")

    def as_dict(self) -> dict:
        """The parameters, for summary outputs."""
        return {**asdict(self), "definition": DEFINITION}


DEFINITION = ("first step (after `warmup` steps) that starts `persistence` consecutive steps with loss (mean of the "
              "last `loss_window` steps) > loss_factor x its running minimum over earlier steps, or with grad norm > "
              "grad_factor x running median of earlier grad norms, or with a non-finite loss (from step 1); a "
              "spike or non-finite loss during a rise dates it to the rise's first step; a rise cut off by the end "
              "of the run is undecided (not a divergence)")


def divergence_step(steps, loss, grad_norm, rule: DivergenceRule = DivergenceRule()) -> tuple[int | None, str]:
    """(first diverging step, reason) under `rule`, or (None, "no divergence ...")."""
    run_min = math.inf
    grads: list[float] = []
    w = rule.loss_window
    what = "loss" if w == 1 else f"mean loss of the last {w} steps"
    rise: list[tuple[int, str]] = []  # (step, reason) of the consecutive loss-rise steps up to now
    for i, (step, lv, gv) in enumerate(zip(steps, loss, grad_norm)):
        if not math.isfinite(lv):
            return (rise[0][0], f"{rise[0][1]}, then a non-finite loss at step {step}") if rise else \
                (step, "non-finite loss")
        lv = statistics.fmean(loss[max(0, i - w + 1):i + 1])
        if i >= rule.warmup:
            if lv > rule.loss_factor * run_min:
                rise.append((step, f"{what} {lv:.4g} > {rule.loss_factor} x running min {run_min:.4g}"))
            else:
                rise = []
            if len(rise) == rule.persistence:
                held = "" if rule.persistence == 1 else f" (held {rule.persistence} steps, to step {step})"
                return rise[0][0], rise[0][1] + held
            if grads and math.isfinite(gv) and gv > rule.grad_factor * statistics.median(grads):
                spike = f"grad norm {gv:.4g} > {rule.grad_factor} x running median {statistics.median(grads):.4g}"
                return (rise[0][0], f"{rise[0][1]}, then a {spike} at step {step}") if rise else (step, spike)
        if i >= w - 1:  # only full windows set the minimum
            run_min = min(run_min, lv)
        if math.isfinite(gv):
            grads.append(gv)
    if rise:
        span = f"step {rise[0][0]}" if len(rise) == 1 else f"steps {rise[0][0]}-{rise[-1][0]}"
        return None, (f"no divergence ({span}: {rise[0][1]}, then the run ended before {rule.persistence} steps "
                      "confirmed the rise: undecided)")
    return None, "no divergence"
