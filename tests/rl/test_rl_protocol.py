"""The false-alarm protocol of the RL matrix: the order-statistic condition, the shipped protocol's figures, the
exact 95% intervals of the measured rate (against scipy.stats), the within-2× verdict and the raw round trip."""
import gzip
import json
import math
import shutil
from pathlib import Path

import pytest
from scipy import stats

from mindspeed_proxy.experiments import rl_heldout as H
from mindspeed_proxy.experiments.matrix import RunResult
from mindspeed_proxy.experiments.rl_matrix import load_rl_config
from mindspeed_proxy.experiments import rl_protocol as P
from mindspeed_proxy.monitor.calibration import CalibrationError, runs_needed, threshold_from_scores
from mindspeed_proxy.monitor.config import MonitorConfig
from mindspeed_proxy.report.intervals import binomial_interval, poisson_interval

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"


@pytest.mark.parametrize("q", [0.6, 0.2, 0.15, 0.12, 0.1, 1 / 3, 0.05, 0.0133, 0.004])
def test_runs_needed_is_the_fewest_runs_with_an_order_statistic(q):
    n = runs_needed(q)
    assert math.floor(q * (n + 1) + 1e-9) >= 1
    assert threshold_from_scores([float(i) for i in range(n)], q, "order")["k"] >= 1
    if n > 1:
        assert math.floor(q * n + 1e-9) == 0  # N − 1 runs: k = 0
        with pytest.raises(CalibrationError, match=f"need ≥ {n} runs"):
            threshold_from_scores([float(i) for i in range(n - 1)], q, "order")


def test_the_shipped_protocol_meets_the_order_condition_and_the_held_out_size():
    cfg = load_rl_config(CONFIGS / "rl_fault_matrix.yaml")
    tested = P.tested_statistics(MonitorConfig.from_file(str(CONFIGS / cfg["calibrate_config"])))
    assert tested == ["rl/topk_match", "rl/any_layer_mismatch", "update-spectral/linear_qkv/frobenius"]
    pc = P.protocol_check(cfg, len(tested))
    assert pc["unmet"] == [] and pc["k"] == 1 and pc["tuning_runs_per_model"] >= pc["runs_needed"]
    assert pc["promise_per_1000_steps"] <= cfg["false_alarms_per_1000_steps"] + 1e-12
    assert pc["heldout_steps_per_model"] >= 1000 and len(cfg["heldout_seeds"]) >= 3
    # by hand: R = 5, 120-step runs, S = 3: q = 0.6, q/S = 0.2, N ≥ 1/0.2 − 1 = 4, k = ⌊0.2 · 5⌋ = 1
    assert P.order_terms(4, 3, 5.0, 120) == pytest.approx({
        "runs": 4, "statistics": 3, "q": 0.6, "q_per_statistic": 0.2, "k": 1, "promise_per_statistic": 0.2,
        "promise_per_run": 0.6, "promise_per_1000_steps": 5.0, "runs_needed": 4})
    fewer = {**cfg, "tuning_seeds": cfg["tuning_seeds"][:2], "healthy_rl_seeds": {5: [501, 502, 503, 504, 505, 506]}}
    assert P.protocol_check(fewer, 3)["unmet"] == [
        "2 tuning runs per model give no order statistic for S = 3 at R = 5 and 120-step runs: need ≥ 4"]
    short = {**cfg, "healthy_rl_seeds": {6: [601]}, "heldout_seeds": [3, 4]}
    assert P.protocol_check(short, 3)["unmet"] == ["2 held-out healthy runs × 120 steps = 240 < 1000 steps per model",
                                                 "2 held-out seeds per fault < 3"]


@pytest.mark.parametrize("x, n", [(0, 9), (1, 9), (3, 10), (9, 9), (5, 100), (0, 1), (17, 40)])
def test_clopper_pearson_matches_the_beta_quantiles(x, n):
    lo, hi = binomial_interval(x, n)
    assert lo == pytest.approx(stats.beta.ppf(0.025, x, n - x + 1) if x else 0.0, rel=1e-9, abs=1e-14)
    assert hi == pytest.approx(stats.beta.ppf(0.975, x + 1, n - x) if x < n else 1.0, rel=1e-9, abs=1e-14)
    # the defining property, from the binomial distribution itself: each bound leaves a 2.5% tail
    if x:
        assert stats.binom.sf(x - 1, n, lo) == pytest.approx(0.025, rel=1e-7)
    if x < n:
        assert stats.binom.cdf(x, n, hi) == pytest.approx(0.025, rel=1e-7)


@pytest.mark.parametrize("count", [0, 1, 2, 3, 12, 40])
def test_garwood_matches_the_chi2_quantiles(count):
    lo, hi = poisson_interval(count)
    assert lo == pytest.approx(stats.chi2.ppf(0.025, 2 * count) / 2 if count else 0.0, rel=1e-9, abs=1e-14)
    assert hi == pytest.approx(stats.chi2.ppf(0.975, 2 * count + 2) / 2, rel=1e-9)
    assert stats.poisson.cdf(count, hi) == pytest.approx(0.025, rel=1e-7)  # each bound leaves a 2.5% tail
    if count:
        assert stats.poisson.sf(count - 1, lo) == pytest.approx(0.025, rel=1e-7)


def test_interval_bad_input_raises():
    for bad in ((3, 2), (-1, 5), (0, 0)):
        with pytest.raises(ValueError):
            binomial_interval(*bad)
    with pytest.raises(ValueError):
        poisson_interval(-1)


def rec(steps, alerts, name):
    return {"rewards": {s: 0.0 for s in range(steps)}, "alerts": alerts, "result": name}


def test_false_alarm_row_scales_the_interval_to_runs_alarmed_per_1000_steps():
    data = {(3, "original_none"): rec(120, 0, "a"), (3, "original_none_s301"): rec(120, 2, "b"),
            (3, "original_lr-spike"): rec(120, 5, "c"), (4, "original_none"): rec(120, 0, "d"),
            (3, "proxy_none"): rec(120, 1, "e"), (9, "original_none"): rec(120, 7, "f")}
    recs = H.healthy_records(data, [3, 4], "original")
    assert [d["result"] for d in recs] == ["a", "b", "d"]  # not the faulted run, the proxy or another seed
    row = H.false_alarm_row("original", recs)
    assert (row["count"], row["steps"], row["alerts"], row["runs alarmed"]) == (3, 360, 2, 1)
    lo, hi = stats.beta.ppf(0.025, 1, 3), stats.beta.ppf(0.975, 2, 2)  # 1 of 3 runs, each 120 steps
    assert row["runs alarmed 95% interval"] == f"[{lo * 1000 / 120:.2f}, {hi * 1000 / 120:.2f}]"
    lo, hi = stats.chi2.ppf(0.025, 4) / 2, stats.chi2.ppf(0.975, 6) / 2  # 2 alerts over 360 steps
    assert row["alerts 95% interval"] == f"[{lo * 1000 / 360:.2f}, {hi * 1000 / 360:.2f}]"
    zero = H.false_alarm_row("x", [rec(120, 0, str(i)) for i in range(9)])
    assert zero["runs alarmed 95% interval"] == f"[0.00, {(1 - 0.025 ** (1 / 9)) * 1000 / 120:.2f}]"  # 2.80


def test_transfer_verdict_is_within_twice_the_original_calibrated_rate():
    def source(alarmed):
        return {(3, f"original_none_s{i}"): rec(100, int(i < alarmed), str(i)) for i in range(10)}

    assert H.transfer_verdict({"original": source(2), "proxy": source(4)}, [3]).startswith("met: proxy-calibrated 4.00")
    assert H.transfer_verdict({"original": source(2), "proxy": source(5)}, [3]).startswith("MISS")
    assert H.transfer_verdict({"original": source(0), "proxy": source(0)}, [3]).startswith("met")
    assert H.transfer_verdict({"original": source(0), "proxy": source(1)}, [3]).startswith("MISS")
    assert H.transfer_verdict({"original": source(1)}, [3]).startswith("not measured")


def test_healthy_rl_seeds_are_checked(tmp_path):
    text = (CONFIGS / "rl_fault_matrix.yaml").read_text()
    for bad, message in (('{"9": [901]}', "key 9 is neither"), ('{"5": [501, 501]}', "reuses seeds [501, 501]"),
                         ('{"5": [3]}', "reuses seeds [3]"), ('{"5": [7], "6": [7]}', "reuses seeds [7]")):
        path = tmp_path / "rl.yaml"
        path.write_text(text.replace('healthy_rl_seeds: {"6": [601], "5": [501, 502, 503, 504, 505, 506]}',
                                     f"healthy_rl_seeds: {bad}"))
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_rl_config(path)


def test_export_then_import_gives_the_same_run_and_its_record(tmp_path):
    """A kept run (real recorded files of the matrix) round-trips: export writes its record without paths,
    import into a fresh work dir restores the files, the record and the non-finite stop."""
    from mindspeed_proxy.experiments.rl_results import NONFINITE_STOP, collect, export_raw, import_raw, record

    src = ROOT / "docs/results/rl_fault_matrix/3/original_grad-overflow"
    run_dir = tmp_path / "work/seed3/runs/original_grad-overflow"
    (run_dir / "mechanism_monitor").mkdir(parents=True)
    for name, dst in (("metrics.jsonl", "metrics.jsonl"), ("monitor.jsonl", "mechanism_monitor/monitor.jsonl")):
        with gzip.open(src / f"{name}.gz", "rb") as fin, open(run_dir / dst, "wb") as fout:
            shutil.copyfileobj(fin, fout)
    (run_dir / "run.log").write_text(f"... {NONFINITE_STOP} ...\n")
    r = RunResult("original_grad-overflow", "original", "grad-overflow", "grad-overflow:start=20", str(run_dir), 2,
                  120, 1, 12.5, 30.0, ["python", "-m", "x", "--log-dir", str(run_dir)])
    sft = RunResult("sft", "original", "none", None, str(tmp_path / "work/seed3/sft_logs"), 2, 200, 0, 3.0, 4.0, [])
    export_raw({(3, r.name): r, (3, "sft"): sft}, tmp_path / "raw", {"original": {"before": 0.1, "after": 0.2}}, 3)
    kept = json.loads((tmp_path / "raw/3/original_grad-overflow/stage.json").read_text())
    assert kept["nonfinite_stop"] is True and "run_dir" not in kept["result"] and str(tmp_path) not in json.dumps(kept)
    assert import_raw(tmp_path / "raw", tmp_path / "fresh", [3]) == 1
    assert import_raw(tmp_path / "raw", tmp_path / "fresh", [3]) == 0  # already there
    got = collect(tmp_path / "fresh", [3])
    back = got[(3, r.name)]
    assert (back.fault, back.spec, back.returncode, back.cpu_s, back.ranks) == ("grad-overflow", r.spec, 1, 12.5, 2)
    assert got[(3, "sft")].cpu_s == 3.0 and json.loads((tmp_path / "fresh/seed3/e4.json").read_text())["original"]
    cfg = {"collapse": {"window": 5, "factor": 0.5}}
    a, b = record(cfg, r, None), record(cfg, back, None)
    assert a["stopped"] == b["stopped"] == 20 and a["rewards"] == b["rewards"]
