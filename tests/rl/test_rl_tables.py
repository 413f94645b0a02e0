"""The RL fault matrix's analysis functions against independent computations on made-up curves."""
import math
import random

import numpy as np
import pytest

from mindspeed_proxy.experiments.rl_tables import collapse_step, moving_average, pearson


def test_collapse_is_the_first_window_below_the_factor_of_the_pre_onset_mean():
    rewards = {s: 0.6 for s in range(1, 21)}
    rewards.update({21: 0.5, 22: 0.2, 23: 0.1, 24: 0.1, 25: 0.1, 26: 0.0, 27: 0.0})
    # window 3, factor 0.5: the mean of (23, 24, 25) = 0.1 < 0.3 is the first; (22, 23, 24) = 0.133 is first
    windows = {s: sum(rewards[t] for t in (s - 2, s - 1, s)) / 3 for s in range(23, 28)}
    expected = min(s for s, m in windows.items() if m < 0.5 * 0.6)
    assert collapse_step(rewards, onset=21, window=3, factor=0.5) == expected == 23
    assert collapse_step(rewards, onset=21, window=3, factor=0.1) == 27  # (24..26) = 0.067, (25..27) = 0.033 < 0.06
    assert collapse_step({s: 0.6 for s in range(1, 30)}, onset=21, window=3, factor=0.5) is None


def test_a_non_finite_reward_collapses_at_once_and_the_healthy_baseline_is_the_first_third():
    rewards = {s: 0.4 for s in range(1, 31)}
    rewards[25] = float("nan")
    assert collapse_step(rewards, onset=21, window=5, factor=0.5) == 25
    healthy = {s: (0.2 if s <= 10 else 0.05) for s in range(1, 31)}  # no onset: baseline = steps 1..10
    # windows may straddle the cut: (10..14) = (0.2 + 4 × 0.05) / 5 = 0.08 < 0.1 is the first
    assert collapse_step(healthy, onset=None, window=5, factor=0.5) == 14


def test_moving_average_and_pearson_match_numpy():
    rng = random.Random(3)
    a = [rng.random() for _ in range(40)]
    b = [x + 0.3 * rng.random() for x in a]
    ma = moving_average(a, 5)
    assert ma[0] == a[0] and ma[4] == pytest.approx(np.mean(a[:5])) and ma[-1] == pytest.approx(np.mean(a[-5:]))
    assert pearson(a, b) == pytest.approx(float(np.corrcoef(a, b)[0, 1]), abs=1e-12)
    assert pearson(a, [1.0] * 40) is None and pearson([1.0], [2.0]) is None
    assert math.isclose(pearson(a, [-x for x in a]), -1.0)


def test_gap_table_averages_the_decomposed_steps_from_the_onset(tmp_path):
    import json

    from mindspeed_proxy.experiments.rl_tables import gap_rows, run_data

    def step(i, flip, other, cause):
        return {"type": "step", "iteration": i, "reward_mean": 0.5, "topk_match_mean": 1.0, "gap_abs_mean": 0.1 * i,
                "gap_flip_share": flip, "gap_weights_share": 0.0, "gap_other_share": other,
                "gap_flipped_token_frac": flip, "gap_cause": cause}
    records = [step(1, 0.0, 1.0, "numeric mismatch"), {"type": "step", "iteration": 2, "reward_mean": 0.5,
                                                       "topk_match_mean": 1.0},
               step(3, 0.9, 0.1, "routing-mismatch: expert flips"), step(4, 0.7, 0.3, "routing-mismatch: expert flips"),
               step(5, 0.2, 0.8, "numeric mismatch")]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    data = {"original_noise": run_data(tmp_path, 3, {"window": 2, "factor": 0.5})}
    (row,) = gap_rows({}, data)
    assert row["run"] == "original_noise" and row["steps"] == 3  # step 1 is before the onset, step 2 has no gap
    assert row["gap_abs_mean"] == pytest.approx(0.4) and row["gap_flip_share"] == pytest.approx(0.6)
    assert row["dominant_cause"] == "routing-mismatch: expert flips"
    assert gap_rows({}, {"x": run_data(tmp_path / "missing", None, {"window": 2, "factor": 0.5})}) == []
