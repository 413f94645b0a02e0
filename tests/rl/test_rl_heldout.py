"""The RL matrix's held-out table maths against hand-computed values on made-up records."""
import json

import pytest

from mindspeed_proxy.experiments import rl_heldout as H
from mindspeed_proxy.experiments.matrix import RunResult
from mindspeed_proxy.experiments.rl_matrix import command_hash


def rec(rewards, collapse, first_step=None, family="rl", onset=20, alerts=None):
    first = None if first_step is None else {"step": first_step, "family": family}
    n = alerts if alerts is not None else (0 if first is None else 1)
    return {"rewards": rewards, "collapse": collapse, "first": first, "onset": onset, "alerts": n,
            "stopped": None, "early_alerts": 0, "families": {}, "result": None}


def test_lead_ratio_and_detection_rate_by_hand():
    assert H.lead_ratio(6, 50, 20) == pytest.approx(0.2)  # 6 / (50 - 20)
    assert H.lead_ratio(3, 20, 20) is None
    records = [rec({}, 50, 44), rec({}, 40, 40), rec({}, 30, 35), rec({}, None, 25), rec({}, 60, None)]
    # collapsed: 50, 40, 30, 60 (4); strictly before: only the first (alert 44 < 50); 40 = 40 is not before
    assert H.detection(records) == {"collapsed": 4, "detected": 1, "rate": 0.25}
    assert H.lead_of(records[0]) == 6 and H.lead_of(records[2]) == -5 and H.lead_of(records[3]) is None
    assert H.detection([rec({}, None)]) == {"collapsed": 0, "detected": 0, "rate": None}


def test_band_distance_is_the_mean_absolute_difference_over_common_steps():
    a, b, c = {1: 0.0, 2: 0.5, 3: 1.0}, {1: 0.2, 2: 0.5, 3: 0.4, 4: 9.0}, {2: 0.0, 3: 0.0}
    assert H.curve_distance(a, b) == pytest.approx((0.2 + 0.0 + 0.6) / 3)
    assert H.curve_distance(a, c) == pytest.approx((0.5 + 1.0) / 2)
    assert H.curve_distance(b, c) == pytest.approx((0.5 + 0.4) / 2)
    assert H.seed_band([a, b, c]) == pytest.approx(0.75)
    assert H.seed_band([a]) is None and H.curve_distance(a, {7: 1.0}) is None


def test_e3_band_rows_count_each_condition_per_seed():
    cfg = {"faults": {"none": None}, "pearson_smoothing": 1}
    flat = {s: 0.5 for s in range(1, 11)}
    data = {(3, "original_none"): rec(flat, None), (4, "original_none"): rec({s: 0.3 for s in flat}, None),
            (3, "proxy_none"): rec({s: 0.4 for s in flat}, None),             # 0.1 from its original: inside 0.2
            (4, "proxy_none"): rec({s: 0.0 for s in flat}, 9, first_step=5)}  # 0.3 away, collapsed, alerted
    row = H.e3_band_rows(cfg, data, [3, 4])[0]
    assert row["band"] == pytest.approx(0.2)
    assert row["proxy–original distance"] == "0.100, 0.300"
    assert (row["within band"], row["same collapse outcome"], row["same first family"]) == ("1 / 2", "1 / 2", "1 / 2")
    assert row["verdict"] == "MISS"


def test_false_alarms_per_1000_steps_and_spread():
    rows = H.false_alarm_row("original", [rec({s: 0.0 for s in range(100)}, None, alerts=3),
                                          rec({s: 0.0 for s in range(150)}, None, alerts=0)])
    assert rows["steps"] == 250 and rows["alerts"] == 3 and rows["runs alarmed"] == 1
    assert rows["alerts per 1000 steps"] == pytest.approx(12.0) and rows["runs alarmed per 1000 steps"] == 4.0
    assert H.spread([4, 1, 9]) == "4 [1, 9]" and H.spread([0.5, 0.25]) == "0.38 [0.25, 0.50]" and H.spread([]) == "–"


def test_detection_rows_name_every_miss_and_the_label():
    cfg = {"faults": {"none": None, "lr-spike": "x"}, "expected_families": {"lr-spike": ["update-spectral"]}}
    data = {(3, "original_lr-spike"): rec({}, 30, 22, family="update-spectral"),
            (4, "original_lr-spike"): rec({}, 40, 25, family="rl"),
            (5, "original_lr-spike"): rec({}, 35, None), (6, "original_lr-spike"): {**rec({}, None), "stopped": 21}}
    row = H.detection_rows(cfg, data, [3, 4, 5, 6])[0]
    assert row["runs"] == 4 and row["stopped by the trainer"] == "seed 6 at 21"
    assert row["detected / collapsed"] == "2 / 3" and row["first family right (E2)"] == "1 / 2"
    assert row["lead (steps)"] == "11.5 [8, 15]"                 # 30 - 22, 40 - 25
    assert row["lead / (collapse − onset)"] == "0.78 [0.75, 0.80]"  # 8 / (30 - 20), 15 / (40 - 20): median 0.775
    assert row["misses"] == "seed 5: no alert"


def test_command_hash_ignores_the_port_and_sees_config_bytes(tmp_path):
    cfg = tmp_path / "m.yaml"
    cfg.write_text("a: 1\n")
    base = ["python", "-m", "torch.distributed.run", "--master-port", "1234", "-m", "x", "--cfg", str(cfg)]
    other_port = [*base[:4], "999", *base[5:]]
    assert command_hash(base) == command_hash(other_port)
    before = command_hash(base)
    cfg.write_text("a: 2\n")
    assert command_hash(base) != before
    assert command_hash([*base, "--seed", "3"]) != command_hash([*base, "--seed", "4"])
    RunResult("n", "original", "none", None, ".", 1, 1, 0, 0.0, 0.0)  # the record type the stages write


def test_replay_keeps_the_online_non_finite_alert_only(tmp_path):
    """A non-finite step's provenance alert has no threshold: the held-out records keep it beside the replay."""
    from mindspeed_proxy.experiments.rl_results import online_nonfinite

    mon = tmp_path / "mechanism_monitor"
    mon.mkdir()
    recs = [{"type": "alert", "step": 5, "family": "rl", "kind": "threshold", "mechanism": "routing-mismatch"},
            {"type": "non-finite", "step": 20, "origin": "decoder.layers.0.mlp.router.weight"},
            {"type": "alert", "step": 20, "family": "non-finite", "kind": "non-finite",
             "mechanism": "non-finite: origin decoder.layers.0.mlp.router.weight (rank 0)"}]
    (mon / "monitor.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    kept = online_nonfinite(tmp_path)
    assert [(a["step"], a["family"]) for a in kept] == [(20, "non-finite")]
    assert online_nonfinite(tmp_path / "missing") == []


def test_noise_floor_rows_and_verdict_by_hand():
    """Healthy series 1, 3, 1, 3 (std 2/√3 ≈ 1.1547); the faulted run's values after onset 2 are the healthy ones
    + 0.5 (shift 0.5, ratio 0.433); the verdict names that ratio and the share of a standard normal beyond it."""
    import statistics

    healthy = {"delta2/entropy": {0: 1.0, 1: 3.0, 2: 1.0, 3: 3.0}}
    faulted = {"delta2/entropy": {0: 9.0, 1: 9.0, 2: 1.5, 3: 3.5}}  # before the onset: not counted
    rows = H.noise_floor_rows({"onset": 2}, {(3, "original_none"): healthy, (3, "original_lowp-attention"): faulted},
                              [3], {})
    (row,) = rows
    std = statistics.stdev([1.0, 3.0, 1.0, 3.0])
    assert row["healthy std"] == pytest.approx(std) and row["faulted shift (mean, after onset)"] == pytest.approx(0.5)
    assert row["shift / std"] == pytest.approx(0.5 / std)
    text = H.noise_floor_verdict(rows, "lowp-attention:start=2")
    beyond = 2 * (1 - statistics.NormalDist().cdf(0.5 / std))  # 66%
    assert f"Largest |shift| / std: {0.5 / std:.2f} (delta2/entropy, original, seed 3)" in text
    assert f"crossed by {100 * beyond:.0f}% of healthy samples" in text and "`lowp-attention:start=2`" in text
    assert H.noise_floor_verdict([], "x").startswith("No lowp-attention run")


def _healthy(alerted: list[str]) -> dict:
    """A 100-step healthy run record whose alerts name `alerted` statistics (family/metric)."""
    alerts = [{"family": s.split("/", 1)[0], "metric": s.split("/", 1)[1], "step": 30 + i} for i, s in enumerate(alerted)]
    return {**rec({s: 0.5 for s in range(100)}, None, alerts=len(alerts)), "alert_list": alerts}


def test_promise_verdict_against_clopper_pearson_and_the_seed_breakdown():
    """9 of 10 runs alarmed: the exact interval's lower end (scipy's beta quantile) is above a promise of 5 per 1000
    100-step runs, so it is broken; 6 of 10: above the promise but the interval includes it; 0: kept."""
    from scipy.stats import beta

    frob, topk = "update-spectral/linear_qkv/frobenius", "rl/topk_match"
    data = {(12, "original_none"): _healthy([]), (13, "original_none"): _healthy([topk])}
    data.update({(14, f"original_none_s{i}"): _healthy([frob, frob]) for i in range(8)})
    data.update({(12, "proxy_none"): _healthy([]), (13, "proxy_none"): _healthy([])})
    data.update({(14, f"proxy_none_s{i}"): _healthy([frob] if i < 6 else []) for i in range(8)})
    data[(14, "original_lr-spike")] = _healthy([frob])  # a faulted run is not a false alarm
    text = H.promise_verdict(data, [12, 13, 14], 5)
    low9, high9 = beta.ppf(0.025, 9, 2) * 10, beta.ppf(0.975, 10, 1) * 10  # per 1000 steps of 100-step runs
    low6 = beta.ppf(0.025, 6, 5) * 10
    assert low9 > 5 > low6
    assert f"original 9.00 [{low9:.2f}, {high9:.2f}] (9 of 10 runs): BROKEN" in text
    assert f"proxy 6.00 [{low6:.2f}, " in text and "(6 of 10 runs): above it, but its 95% interval includes it" in text
    assert "kept" in H.promise_verdict({k: v for k, v in data.items() if k[0] == 12}, [12], 5)
    rows = {(r["seed"], r["model"]): r for r in H.false_alarms_by_seed(data, [12, 13, 14])}
    assert rows[(14, "original")] == {"seed": 14, "model": "original", "healthy runs": 8, "runs alarmed": 8,
                                      "alerts": 16, "statistics that alerted": frob}
    assert rows[(13, "original")]["statistics that alerted"] == topk and rows[(12, "proxy")]["runs alarmed"] == 0
    assert rows[(14, "proxy")]["runs alarmed"] == 6 and len(rows) == 6
