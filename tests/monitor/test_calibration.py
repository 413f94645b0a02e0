"""`mindspeed-proxy calibrate`: the false-alarm rate it promises holds on fresh synthetic runs of known law.

Tolerances: the promise with k = 1 of N = 19 tuning runs is P(alarm per run) = 1/20 exactly for
continuous scores, averaged over tuning sets; each rate below averages B calibrations × M fresh runs,
so its standard deviation is ≈ 0.01 (B = 40) and the accepted band is 0.05 ± 0.02 (± 0.03 for B = 20).
A quantile off by one (k = 2: 0.10) or taken over samples instead of per-run maxima falls outside.
"""
import json
import random
import subprocess
import sys

import pytest

from mindspeed_proxy.monitor.calibration import (FORMS, CalibrationError, bisect_score, calibrate_statistics,
                                                 form_config, series_score, threshold_from_scores)
from mindspeed_proxy.monitor.config import MonitorConfig
from mindspeed_proxy.monitor.detectors import DetectorConfig, SeriesDetector

BASE = DetectorConfig(warmup=10, persistence=2, direction="down", min_scale=1e-8, ema_alpha=0.1, cusum_k=0.5)
T, N, Q = 50, 19, 0.05  # steps (= samples) per tuning run, tuning runs, per-run budget: k = ⌊Q·(N+1)⌋ = 1


def iid(rng, n):
    """iid Gaussian N(5, 0.1²)."""
    return [5.0 + 0.1 * rng.gauss(0.0, 1.0) for _ in range(n)]


def ar1_drift(rng, n, phi=0.7, drift=-0.03):
    """AR(1) with unit innovations plus a downward drift per sample (a baseline that moves while healthy)."""
    x, out = 0.0, []
    for i in range(n):
        x = phi * x + rng.gauss(0.0, 1.0)
        out.append(10.0 + x + drift * i)
    return out


def alarmed(values, cfg, kind) -> bool:
    """Whether the real detector raises an alert of `kind` on `values`."""
    det = SeriesDetector(cfg)
    return any((a := det.update(i, v)) is not None and a["kind"] == kind for i, v in enumerate(values))


def realized_rate(gen, form, seed, repeats, fresh, rule="calibrate", fresh_len=T):
    """Mean fraction of fresh runs alarmed, over `repeats` calibrations on N tuning runs each."""
    rng, kind, rates = random.Random(seed), FORMS[form][2], []
    for _ in range(repeats):
        tuning = [gen(rng, T) for _ in range(N)]
        scores = [series_score(v, BASE, form) for v in tuning]
        if rule == "calibrate":
            tau = threshold_from_scores(scores, Q, "order")["threshold"]
        elif rule == "off-by-one":  # the (k+1)-th largest
            tau = sorted(scores, reverse=True)[1]
        else:  # per-sample: the (1 − Q) quantile of every sample's persistence-window z, pooled
            pooled = sorted(z for v in tuning for z in window_scores(v, form))
            tau = pooled[int((1 - Q) * len(pooled))]
        cfg = form_config(BASE, form, tau)
        rates.append(sum(alarmed(gen(rng, fresh_len), cfg, kind) for _ in range(fresh)) / fresh)
    return sum(rates) / repeats


def window_scores(values, form):
    """Per-sample scores (the wrong quantile's input): each sample's window minimum of z."""
    det, z = SeriesDetector(form_config(BASE, form, 1e9)), []
    for i, v in enumerate(values):
        if det.ready:
            z.append(det._z(v))
        det.update(i, v)
    p = BASE.persistence
    return [min(z[i - p + 1:i + 1]) for i in range(p - 1, len(z))]


@pytest.mark.parametrize("form", ["frozen", "cusum"])
def test_promised_rate_holds_on_fresh_iid_runs_and_a_wrong_quantile_breaks_it(form):
    assert threshold_from_scores([1.0] * N, Q, "order")["promised"] == pytest.approx(1 / 20)
    assert 0.03 <= realized_rate(iid, form, 1, repeats=40, fresh=50) <= 0.07
    assert realized_rate(iid, form, 1, repeats=40, fresh=50, rule="off-by-one") > 0.085
    if form == "frozen":
        assert realized_rate(iid, form, 1, repeats=5, fresh=50, rule="per-sample") > 0.5


@pytest.mark.parametrize("form", ["frozen", "ema"])
def test_promised_rate_holds_on_drifting_ar1_runs_of_the_tuning_length(form):
    assert 0.02 <= realized_rate(ar1_drift, form, 3, repeats=20, fresh=40) <= 0.08
    assert realized_rate(ar1_drift, form, 3, repeats=20, fresh=40, rule="off-by-one") > 0.08


@pytest.mark.parametrize("form", list(FORMS))
def test_score_is_the_smallest_quiet_parameter_of_the_real_detector(form):
    rng = random.Random(7)
    _, field, kind = FORMS[form]
    for _ in range(5):
        values = ar1_drift(rng, 40, drift=-0.05)
        score = series_score(values, BASE, form)
        assert score > 0
        assert score == pytest.approx(bisect_score(values, form_config(BASE, form), field, kind), rel=1e-6)
        assert not alarmed(values, form_config(BASE, form, score * (1 + 1e-6)), kind)
        assert alarmed(values, form_config(BASE, form, score * (1 - 1e-4)), kind)


def test_threshold_rule_order_statistic_and_gumbel():
    scores = [float(s) for s in range(1, 40)]  # N = 39
    assert threshold_from_scores(scores, 0.1, "order") == {"threshold": 36.0, "tail": "order", "k": 4, "runs": 39,
                                                           "promised": 0.1}
    with pytest.raises(ValueError, match="need ≥ 99 runs"):
        threshold_from_scores(scores, 0.01, "order")
    gumbel = threshold_from_scores(scores, 0.01, "auto")
    assert gumbel["tail"] == "gumbel" and gumbel["threshold"] > max(scores)
    with pytest.raises(ValueError, match="no spread"):
        threshold_from_scores([0.0, 0.0, 0.0], 0.01, "auto")


def test_a_statistic_without_spread_keeps_its_base_detector_and_is_listed():
    """A statistic that never moves on the healthy runs (e.g. top-k match 1.0 without a fault) scores 0 on all of
    them: no threshold exists; with `skipped` it is left out and named, the others are still calibrated."""
    rng = random.Random(3)
    runs = [{("rl", "flat"): [[1.0] * T], ("rl", "noisy"): [iid(rng, T)]} for _ in range(N)]
    bases = {("rl", "flat"): BASE, ("rl", "noisy"): BASE}
    with pytest.raises(CalibrationError, match="rl/flat"):
        calibrate_statistics(runs, bases, "frozen", 2 * Q, "gumbel")
    skipped: dict = {}
    out = calibrate_statistics(runs, bases, "frozen", 2 * Q, "gumbel", skipped)
    assert set(out) == {("rl", "noisy")} and list(skipped) == ["rl/flat"] and "no spread" in skipped["rl/flat"]
    expected = threshold_from_scores([series_score(r[("rl", "noisy")][0], BASE, "frozen") for r in runs], Q, "gumbel")
    assert out[("rl", "noisy")]["threshold"] == expected["threshold"]  # the budget is still split over both
    with pytest.raises(CalibrationError, match="no statistic could be calibrated"):
        calibrate_statistics([{("rl", "flat"): [[1.0] * T]}] * N, {("rl", "flat"): BASE}, "frozen", Q, "gumbel", {})


# ---------------------------------------------------------------- run directories and the CLI
SYNTH_CONFIG = MonitorConfig(
    families=["rl"], detect_metrics={"rl": ["topk_match"]}, detect_scopes={"rl": ["mean"]}, rl_metric_detectors={},
    rl_detector=DetectorConfig(warmup=10, persistence=2, min_scale=1e-8, min_rel_scale=0.0, ema_alpha=0.1,
                               cusum_k=0.5), sinks=[]).to_dict()


def write_run(path, values, faults=None):
    """A run dir as the RL loop writes it: metrics.jsonl (one step per sample) and the rl family's samples."""
    (path / "mechanism_monitor").mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps({"type": "step", "iteration": i + 1, "loss": 0.0}) + "\n"
                                                for i in range(len(values))))
    records = [{"type": "config", "config": SYNTH_CONFIG}] + ([{"type": "faults", "faults": faults}] if faults else [])
    records += [{"type": "sample", "family": "rl", "step": i + 1, "layers": {"all": {"topk_match": v}}}
                for i, v in enumerate(values)]
    (path / "mechanism_monitor" / "monitor.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def calibrate(capsys, *argv):
    """Run `mindspeed-proxy calibrate` (the console entry point's main): (rc, stdout, stderr)."""
    from mindspeed_proxy.cli import main

    capsys.readouterr()
    rc = main(["calibrate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def synth_runs(tmp_path_factory):
    root, rng = tmp_path_factory.mktemp("calibrate"), random.Random(11)
    tuning = [write_run(root / f"tune{i}", ar1_drift(rng, T)) for i in range(N)]
    long_held = [write_run(root / f"held{i}", ar1_drift(rng, 3 * T)) for i in range(40)]
    return root, tuning, long_held


def test_calibrate_chooses_the_form_by_held_out_runs_and_replay_keeps_the_promise(synth_runs, capsys):
    from mindspeed_proxy.report.replay import replay_alerts
    from mindspeed_proxy.report.runs import load_run

    root, tuning, held = synth_runs
    out = root / "monitor.yaml"
    rc, stdout, stderr = calibrate(capsys, *tuning, "--false-alarms-per-1000-steps", "1", "--out", str(out),
                                   "--forms", "frozen,cusum,ema", "--held-out", *held)
    assert rc == 0, stderr
    assert "budget 1 per 1000 steps = 0.05 per run, split over 1 statistics" in stdout
    assert "P(alarm) ≤ 0.05 per run (k=1 of N=19)" in stdout
    assert "[ema] promise: P(a false alarm in a 50-step run) ≤ 0.05 = 1 per 1000 steps\n" in stdout
    config = MonitorConfig.from_file(str(out))
    rates = config.calibration["held_out"]["forms"]
    # a frozen baseline (and its CUSUM) cannot follow the drift over 3x longer held-out runs; the EMA can
    assert rates["frozen"]["alarmed_per_1000"] > 1.0 and rates["cusum"]["alarmed_per_1000"] > 1.0
    assert rates["ema"]["alarmed_per_1000"] <= 1.0
    assert config.calibration["form"] == "ema" and "form: ema" in stdout
    override = config.metric_detectors["rl"]["topk_match"]
    assert override["method"] == "ema" and override["cusum"] is False
    cfg = config.metric_detector_configs("rl")["topk_match"]
    assert cfg.z_threshold == override["z_threshold"] == config.calibration["statistics"]["rl/topk_match"]["threshold"]
    # k = 1: the threshold is the largest tuning score, so replay finds no alert on any tuning run ...
    tuning_alerts = [replay_alerts(load_run(p), config) for p in tuning]
    assert tuning_alerts == [[]] * N
    # ... and below it (the next float down the largest score) exactly the run that set it alarms
    lower = MonitorConfig.from_dict({**config.to_dict(), "metric_detectors": {"rl": {"topk_match": {
        **override, "z_threshold": override["z_threshold"] * (1 - 1e-6)}}}})
    assert sum(bool(replay_alerts(load_run(p), lower)) for p in tuning) == 1
    # the replay command reads the same file
    proc = subprocess.run([sys.executable, "-m", "mindspeed_proxy.cli", "replay", tuning[0],
                           "--mechanism-monitor-config", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "rl                    0 alert(s), none" in proc.stdout, proc.stderr


def online_alerts(config_path, output_dir, runs):
    """The online monitor built from `--mechanism-monitor-config` fed each run's rl samples: its alerts per run."""
    from mindspeed_proxy.monitor import MechanismMonitor
    from mindspeed_proxy.monitor.arguments import monitor_config_from_args, monitor_flags_in
    from mindspeed_proxy.testing.parallel import init_parallel
    from mindspeed_proxy.tiny_moe import TinyMoEConfig
    from mindspeed_proxy.training.engine import TrainConfig, Trainer

    init_parallel()
    trainer = Trainer(TinyMoEConfig(num_layers=1), TrainConfig(micro_batch_size=2, global_batch_size=2))
    config = monitor_config_from_args(monitor_flags_in(["--mechanism-monitor-config", config_path,
                                                        "--mechanism-monitor-output", output_dir]))
    out = []
    for values in runs:
        monitor = MechanismMonitor(config, trainer.model, trainer.optimizer)
        for step, v in enumerate(values, start=1):
            monitor.on_rl_step(step, {"topk_match": {None: v}})
        out.append([(a.step, a.metric, a.kind) for a in monitor.alerts])
        monitor.close()
    return out


def test_online_monitor_reads_the_calibrated_config_and_alerts_as_replay(synth_runs, tmp_path, capsys):
    from mindspeed_proxy.report.replay import replay_alerts
    from mindspeed_proxy.report.runs import load_run
    from mindspeed_proxy.testing import run_distributed

    root, tuning, held = synth_runs
    out = tmp_path / "monitor.json"
    rc, _, stderr = calibrate(capsys, *tuning, "--false-alarms-per-1000-steps", "1", "--out", str(out), "--forms", "frozen")
    assert rc == 0, stderr
    config = MonitorConfig.from_file(str(out))
    runs = [load_run(p) for p in held[:8]]
    replayed = [[(a["step"], a["metric"], a["kind"]) for a in replay_alerts(r, config)] for r in runs]
    assert any(replayed) and not all(replayed)  # the drifting long runs: some alarm, some do not
    series = [[s["layers"]["all"]["topk_match"] for s in r.samples["rl"]] for r in runs]
    online = run_distributed(online_alerts, 1, str(out), str(tmp_path / "mon"), series)[0]
    assert [[tuple(a) for a in run] for run in online] == replayed


@pytest.mark.parametrize("case,message", [
    ("missing", "not a directory"),
    ("no-samples", "no healthy samples"),
    ("faulted", "not a healthy run"),
    ("rate-zero", "--false-alarms-per-1000-steps must be > 0, got 0.0"),
    ("rate-negative", "--false-alarms-per-1000-steps must be > 0, got -1.0"),
    ("too-few", "need ≥ 199 runs"),
    ("bad-form", "--forms: unknown ['slope']"),
])
def test_bad_input_one_line_exit_2_nothing_written(synth_runs, tmp_path, capsys, case, message):
    root, tuning, _ = synth_runs
    runs, rate, extra = tuning[:3], "1", []
    if case == "missing":
        runs = [str(tmp_path / "absent")]
    elif case == "no-samples":
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "metrics.jsonl").write_text('{"type": "step", "iteration": 1, "loss": 0.0}\n')
        runs = [str(tmp_path / "empty")]
    elif case == "faulted":
        runs = [write_run(tmp_path / "faulted", [1.0] * 20, faults=[{"name": "lr-spike", "start": 5}])]
    elif case.startswith("rate"):
        rate = "0" if case == "rate-zero" else "-1"
    elif case == "too-few":
        rate, extra = "0.1", ["--tail", "order"]
    else:
        extra = ["--forms", "frozen,slope"]
    out = tmp_path / "out.yaml"
    rc, stdout, stderr = calibrate(capsys, *runs, "--false-alarms-per-1000-steps", rate, "--out", str(out), *extra)
    assert rc == 2 and stdout == ""
    assert len(stderr.strip().splitlines()) == 1 and message in stderr, stderr
    assert not out.exists() and not list(tmp_path.glob(".calibrate-*"))


def test_help_and_old_configs_stay_valid():
    proc = subprocess.run([sys.executable, "-m", "mindspeed_proxy.cli", "calibrate", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--false-alarms-per-1000-steps R" in proc.stdout
    old = MonitorConfig.from_dict({"rl_metric_detectors": {"entropy": {"z_threshold": 3.2}}})
    assert old.metric_detectors == {} and old.metric_detector_configs("rl")["entropy"].z_threshold == 3.2
    both = MonitorConfig.from_dict({"rl_metric_detectors": {"entropy": {"z_threshold": 3.2, "warmup": 7}},
                                    "metric_detectors": {"rl": {"entropy": {"z_threshold": 9.0}},
                                                         "update-spectral": {"linear_qkv/frobenius": {"cusum_h": 3}}}})
    rl = both.metric_detector_configs("rl")["entropy"]
    assert (rl.z_threshold, rl.warmup) == (9.0, 7)
    banks = both.detector_banks()
    assert banks["update-spectral"].detector(("update-spectral", "linear_qkv/frobenius", 0, None)).config.cusum_h == 3.0
    assert banks["attention-spectral"] is banks["update-spectral"]
    with pytest.raises(ValueError, match="metric_detectors router/entropy: .*z_threshold"):
        MonitorConfig.from_dict({"metric_detectors": {"router": {"entropy": {"z_threshold": "high"}}}})
    with pytest.raises(ValueError, match="metric_detectors: 'loss'"):
        MonitorConfig.from_dict({"metric_detectors": {"loss": {}}})


def test_a_threshold_of_zero_is_printed_with_what_it_means(tmp_path, capsys):
    """Tuning runs whose statistic never leaves its baseline all score 0: the order statistic is 0 (any move of a
    new run alerts), which the command says next to the threshold."""
    tuning = [write_run(tmp_path / f"flat{i}", [1.0] * T) for i in range(3)]  # q = 5 × 50 / 1000 = 0.25: N ≥ 3
    rc, stdout, stderr = calibrate(capsys, *tuning, "--false-alarms-per-1000-steps", "5", "--out",
                                   str(tmp_path / "m.yaml"), "--forms", "frozen", "--tail", "order")
    assert rc == 0, stderr
    assert "rl/topk_match: z_threshold = 0; P(alarm) ≤ 0.25 per run (k=1 of N=3); every tuning run scored 0" in stdout
    noisy = [write_run(tmp_path / f"noisy{i}", iid(random.Random(i), T)) for i in range(3)]
    rc, stdout, _ = calibrate(capsys, *noisy, "--false-alarms-per-1000-steps", "5", "--out",
                              str(tmp_path / "n.yaml"), "--forms", "frozen", "--tail", "order")
    assert rc == 0 and "every tuning run scored 0" not in stdout and "k=1 of N=3" in stdout
