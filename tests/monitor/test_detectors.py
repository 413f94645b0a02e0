"""Change detectors: step changes flagged in time, stationary noise quiet, state round trip exact, NaN flagged."""
import json
import math
import random

import pytest

from mindspeed_proxy.monitor.detectors import (
    Alert,
    DetectorBank,
    DetectorConfig,
    SeriesDetector,
)

FALSE_ALARM_RATE = 1e-5  # stated bound per sample for the default config on iid Gaussian noise


def feed(detector, values, start=0):
    alerts = []
    for step, value in enumerate(values, start):
        alert = detector.update(step, value)
        if alert is not None:
            alerts.append(alert)
    return alerts


def noisy(seed, n, mean=5.0, sigma=0.1):
    rng = random.Random(seed)
    return [rng.gauss(mean, sigma) for _ in range(n)]


@pytest.mark.parametrize("method", ["median_mad", "ema"])
def test_step_drop_flagged_within_persistence_window_and_once_per_excursion(method):
    cfg = DetectorConfig(method=method, direction="down")
    series = noisy(0, 400)
    for t in range(200, 300):
        series[t] -= 1.0  # a 10σ drop lasting 100 samples
    for t in range(350, 400):
        series[t] -= 1.0  # a second excursion after recovery
    alerts = feed(SeriesDetector(cfg), series)
    assert [a["step"] for a in alerts] == [200 + cfg.persistence - 1, 350 + cfg.persistence - 1]
    first = alerts[0]
    assert first["kind"] == "threshold" and first["z"] > cfg.z_threshold
    assert first["baseline"] == pytest.approx(5.0, abs=0.05)


def test_direction_is_one_sided():
    series = noisy(1, 300)
    for t in range(150, 300):
        series[t] += 1.0  # a rise
    assert feed(SeriesDetector(DetectorConfig(direction="down")), series) == []
    up = feed(SeriesDetector(DetectorConfig(direction="up")), series)
    assert [a["step"] for a in up] == [152]


def test_short_spikes_below_persistence_do_not_alert():
    series = noisy(2, 300)
    for t in (100, 101, 150, 151, 200):
        series[t] -= 2.0  # 20σ, but never 3 samples in a row
    assert feed(SeriesDetector(DetectorConfig()), series) == []
    assert len(feed(SeriesDetector(DetectorConfig(persistence=1)), series)) == 3


def test_cusum_catches_a_small_sustained_shift_the_threshold_misses():
    series = noisy(3, 400, sigma=1.0, mean=0.0)
    for t in range(200, 400):
        series[t] -= 2.5  # 2.5σ: z rarely passes 4 three times in a row
    plain = feed(SeriesDetector(DetectorConfig()), series)
    with_cusum = feed(SeriesDetector(DetectorConfig(cusum=True)), series)
    assert plain == [] or plain[0]["step"] > 230
    assert with_cusum and with_cusum[0]["kind"] == "cusum" and 200 <= with_cusum[0]["step"] <= 225
    assert len(with_cusum) == 1  # one excursion, one alert


@pytest.mark.parametrize("cusum", [False, True])
def test_stationary_noise_false_alarm_rate(cusum):
    total, alerts = 0, 0
    for seed in range(20):
        series = noisy(100 + seed, 10_000, mean=2.0, sigma=0.3)
        alerts += len(feed(SeriesDetector(DetectorConfig(cusum=cusum)), series))
        total += len(series)
    assert alerts <= FALSE_ALARM_RATE * total  # ≤ 2 alerts in 200,000 samples


def test_constant_warmup_uses_min_scale_floor():
    det = SeriesDetector(DetectorConfig(direction="up", warmup=10))
    assert feed(det, [0.0] * 30) == []
    assert det.scale == DetectorConfig().min_scale
    alerts = feed(det, [1.0] * 3, start=30)
    assert len(alerts) == 1 and math.isfinite(alerts[0]["z"])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_value_alerts_immediately_even_in_warmup(bad):
    det = SeriesDetector(DetectorConfig(warmup=10))
    assert feed(det, noisy(4, 5)) == []
    alert = det.update(5, bad)
    assert alert is not None and alert["kind"] == "non-finite" and alert["step"] == 5
    assert det.update(6, bad) is None  # a run of non-finite samples is one excursion
    assert feed(det, noisy(5, 100), start=7) == []  # the bad samples did not poison the baseline
    assert det.ready and det.baseline == pytest.approx(5.0, abs=0.05)
    assert det.update(107, bad)["kind"] == "non-finite"  # re-armed by the finite samples


def series_for(key_index, n):
    values = noisy(10 + key_index, n)
    for t in range(600, n):
        values[t] += (-1.0) ** key_index * 1.0  # half the series drop, half rise
    return values


KEYS = [
    ("attention-spectral", "delta2/entropy", 0, 3),
    ("update-spectral", "stable_rank", 1, None),
    ("router", "similarity", 2, None),
    ("router", "entropy", 2, None),
    ("router", "dead_experts", 1, None),
]


def run_bank(bank, steps, data):
    alerts = []
    for step in steps:
        alerts += bank.update_many(step, {key: data[i][step] for i, key in enumerate(KEYS)})
    return alerts


@pytest.mark.parametrize("split", [20, 300])  # mid warm-up and after it
@pytest.mark.parametrize("method", ["median_mad", "ema"])
def test_bank_state_dict_round_trip_continues_identically(split, method):
    config = DetectorConfig(method=method, cusum=True)
    data = [series_for(i, 900) for i in range(len(KEYS))]
    data[4] = [0.0] * 700 + [3.0] * 200  # dead experts appear
    uninterrupted = DetectorBank(config=config)
    reference = run_bank(uninterrupted, range(900), data)
    assert reference, "the scenario must produce alerts"

    first = DetectorBank(config=config)
    before = run_bank(first, range(split), data)
    state = json.loads(json.dumps(first.state_dict(), allow_nan=False))
    resumed = DetectorBank()
    resumed.load_state_dict(state)
    after = run_bank(resumed, range(split, 900), data)
    assert before + after == reference
    assert json.dumps(resumed.state_dict(), sort_keys=True) == json.dumps(uninterrupted.state_dict(), sort_keys=True)


def test_bank_directions_families_and_alert_labels():
    bank = DetectorBank(config=DetectorConfig(warmup=20))
    shifts = {0: -1.0, 1: -1.0, 2: -1.0, 3: +1.0}  # entropy↓, stable rank↓, similarity↓, entropy↑
    data = {i: noisy(20 + i, 700) for i in shifts}
    for i, shift in shifts.items():
        data[i][600:] = [v + shift for v in data[i][600:]]
    alerts = []
    for step in range(700):
        alerts += bank.update_many(step, {key: data[i][step] for i, key in enumerate(KEYS[:4])})
    by_metric = {a.metric: a for a in alerts}
    assert set(by_metric) == {"delta2/entropy", "stable_rank"}  # only moves in the mechanism direction
    attn = by_metric["delta2/entropy"]
    assert isinstance(attn, Alert) and attn.step == 602 and attn.layer == 0 and attn.head_or_expert == 3
    assert attn.family == "attention-spectral" and "FP32 accumulation of P·V" in attn.mitigation
    assert by_metric["stable_rank"].family == "update-spectral"
    assert "low-rank" in by_metric["stable_rank"].mitigation
    assert bank.detector(KEYS[0]).config.direction == "down"
    assert bank.detector(KEYS[2]).config.direction == "up"
    assert json.dumps(attn.to_dict())
    router = [bank.update(KEYS[2], step, 6.0) for step in range(700, 703)]
    assert router[:2] == [None, None] and router[2].family == "router"
    assert router[2].mitigation == "routing collapse: lower LR, raise global batch, fp32 router, z-loss or expert bias"


def test_bank_non_finite_labels_and_validation():
    bank = DetectorBank()
    alert = bank.update(("update-spectral", "entropy", 4, None), 7, math.nan)
    assert alert.kind == "non-finite" and alert.family == "update-spectral" and "non-finite" in alert.mechanism
    with pytest.raises(KeyError):
        bank.update(("router", "mystery_metric", 0, None), 0, 1.0)
    with pytest.raises(ValueError):
        bank.update(("loss", "entropy", 0, None), 0, 1.0)
    with pytest.raises(ValueError):
        DetectorConfig(direction="sideways")
    # YAML 1.1 reads "1.0e9" as a string: numeric strings are coerced, anything else names the key
    assert DetectorConfig(z_threshold="1.0e9", warmup=6.0).z_threshold == 1e9
    for bad, key in (({"z_threshold": "high"}, "z_threshold"), ({"warmup": 5.5}, "warmup"),
                     ({"cusum": "yes"}, "cusum")):
        with pytest.raises(ValueError, match=key):
            DetectorConfig(**bad)


def test_bank_per_metric_config_and_tensor_values():
    torch = pytest.importorskip("torch")
    bank = DetectorBank(metric_configs={"overload": DetectorConfig(warmup=5, persistence=1)})
    key = ("router", "overload", 0, None)
    for step in range(5):
        assert bank.update_many(step, {key: torch.tensor(1.0 + 0.01 * (step % 2))}) == []
    alerts = bank.update_many(5, {key: torch.tensor(2.0)})
    assert len(alerts) == 1 and alerts[0].value == 2.0
    assert bank.detector(key).config.warmup == 5 and bank.detector(key).config.direction == "up"
