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
