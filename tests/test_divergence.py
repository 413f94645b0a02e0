"""The divergence rule (report/divergence.py) on synthetic loss / grad-norm curves: a noisy healthy short run's
last-step blip is undecided, not a divergence; sustained rises, gradient spikes and NaN losses still are."""
import math

import numpy as np
import pytest

from mindspeed_proxy.report.compare import compare_runs
from mindspeed_proxy.report.divergence import DivergenceRule, divergence_step


def healthy(n=30, seed=0):
    """A decaying loss with ±15% multiplicative small-batch noise and a flat grad norm, like a short healthy run."""
    rng = np.random.default_rng(seed)
    loss = 1.5 * np.exp(-np.arange(n) / 8) + 0.2
    return list(range(1, n + 1)), list(loss * (1 + 0.15 * rng.uniform(-1, 1, n))), list(1.5 + 0.3 * rng.random(n))


def test_a_blip_on_the_last_step_of_a_healthy_short_run_is_undecided_not_a_divergence():
    steps, loss, gn = healthy()
    loss[-1] = 1.6 * min(loss[:-1])  # the proxy's step 29-of-30 case of issue 35: one step above 1.5 x the minimum
    assert divergence_step(steps, loss, gn, DivergenceRule(persistence=1))[0] == 30  # the former per-step rule
    div, reason = divergence_step(steps, loss, gn)
    assert div is None and "undecided" in reason and "step 30" in reason
    loss[-2] = 1.7 * min(loss[:-2])  # two blips at the end: still fewer than persistence 3
    div, reason = divergence_step(steps, loss, gn)
    assert div is None and "steps 29-30" in reason


def test_a_one_step_blip_mid_run_is_not_a_divergence():
    steps, loss, gn = healthy()
    loss[19] = 2.0 * min(loss[:19])
    assert divergence_step(steps, loss, gn)[0] is None
    assert divergence_step(steps, loss, gn, DivergenceRule(persistence=1))[0] == 20


@pytest.mark.parametrize("persistence", [1, 2, 3, 5])
def test_a_sustained_rise_diverges_at_its_first_step(persistence):
    steps, loss, gn = healthy(40, seed=persistence)
    for i in range(24, 40):  # the loss climbs from step 25 on and stays up
        loss[i] = min(loss[:24]) * (1.6 + 0.2 * (i - 24))
    div, reason = divergence_step(steps, loss, gn, DivergenceRule(persistence=persistence))
    assert div == 25 and "running min" in reason
    cut = 24 + persistence - 1  # the same rise cut off one step before it is confirmed: undecided
    div, reason = divergence_step(steps[:cut], loss[:cut], gn[:cut], DivergenceRule(persistence=persistence))
    assert div is None and ("undecided" in reason if persistence > 1 else reason == "no divergence")


def test_a_gradient_spike_or_a_nan_loss_diverges_at_once_and_dates_back_to_a_rise_under_way():
    steps, loss, gn = healthy()
    spiked = gn[:14] + [20 * float(np.median(gn[:14]))] + gn[15:]
    assert divergence_step(steps, loss, spiked)[0] == 15
    nan = loss[:-1] + [math.nan]  # a NaN on the last step: no steps needed to confirm it
    assert divergence_step(steps, nan, gn) == (30, "non-finite loss")
    rising = loss[:20] + [2 * min(loss[:20])] * 2 + [math.nan] + loss[23:]  # rise at 21, 22, NaN at 23
    div, reason = divergence_step(steps, rising, gn)
    assert div == 21 and "non-finite loss at step 23" in reason
    blip = loss[:20] + [2 * min(loss[:20])] * 2 + loss[22:]  # a two-step rise at 21-22, a spike at 22
    div, reason = divergence_step(steps, blip, gn[:21] + [spiked[14]] + gn[22:])
    assert div == 21 and "grad norm" in reason and "at step 22" in reason
    assert divergence_step(steps, blip, gn)[0] is None  # the same rise without the spike: not a divergence


def test_compare_of_two_healthy_short_runs_is_consistent_despite_a_last_step_blip(tmp_path):
    import json

    for name, seed, blip in (("a", 1, False), ("b", 1, True)):
        steps, loss, gn = healthy(seed=seed)
        if blip:
            loss[-1] = 1.6 * min(loss[:-1])
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "metrics.jsonl", "w", encoding="utf-8") as fh:
            for s, lv, g in zip(steps, loss, gn):
                fh.write(json.dumps({"type": "step", "iteration": s, "loss": lv, "grad_norm": g}) + "\n")
    result = compare_runs(tmp_path / "a", tmp_path / "b")
    assert not result["b"]["diverged"] and "undecided" in result["b"]["divergence_reason"]
    assert result["verdict"] == "consistent", result["reasons"]
    former = compare_runs(tmp_path / "a", tmp_path / "b", DivergenceRule(persistence=1))
    assert former["verdict"] == "inconsistent" and "one run diverged and the other did not" in former["reasons"]


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="persistence"):
        DivergenceRule(persistence=0)
