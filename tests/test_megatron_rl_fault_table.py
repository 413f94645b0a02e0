"""The train_rl.py fault table (mindspeed_proxy.experiments.megatron_rl_faults) on small synthetic run folders:
rewards from rollout pickles, alerts and expert mismatch from monitor.jsonl, verdicts, checked by hand."""
from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from mindspeed_proxy.experiments.megatron_rl_faults import FaultRun, rollout_rewards, summarize, table, verdict

ONSET = 5
REPO = Path(__file__).resolve().parents[1]


def _pickle(path, rewards):
    path.write_bytes(pickle.dumps([[SimpleNamespace(reward=r) for r in group] for group in rewards]))


def _monitor(path, mismatch: dict, alerts: list, repeats: dict | None = None):
    records = [{"type": "config", "num_experts": 8}]
    records += [{"type": "sample", "family": "rl", "step": s,
                 "layers": {"all": {"any_layer_mismatch": v, **({"duplicate_share": repeats[s]} if s in (repeats or {})
                                                               else {})}, "0": {"topk_match": 1 - v}}}
                for s, v in mismatch.items()]
    records += [{"type": "sample", "family": "update-spectral", "step": s, "layers": {}} for s in mismatch]
    records += [{"type": "alert", "step": s, "family": f, "metric": m, "layer": layer, "mechanism": mech}
                for s, f, m, layer, mech in alerts]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")


def test_rollout_rewards_are_the_mean_per_iteration_of_rank0_pickles(tmp_path):
    """Iteration N's file (0-based) is iteration N+1; every rollout of every group counts; other ranks do not."""
    _pickle(tmp_path / "rollouts_rank0_iteration0_cfg.pkl", [[0.5, 1.0], [0.0, 0.25]])
    _pickle(tmp_path / "rollouts_rank0_iteration9_cfg.pkl", [[0.2, 0.2, 0.2], [0.8]])
    _pickle(tmp_path / "rollouts_rank1_iteration0_cfg.pkl", [[9.0]])
    assert rollout_rewards(tmp_path) == {1: pytest.approx(0.4375), 10: pytest.approx(0.35)}


def test_summary_of_a_faulted_run(tmp_path):
    """Alerts split at the onset, the first (and first routing-mismatch) alert, mismatch before / after, reward
    before the onset and over the last 5 iterations, and the collapse step (5-iteration mean < half)."""
    rewards = {s: (0.8 if s <= 6 else 0.2) for s in range(1, 11)}
    # step 9's window (5..9) is 2.2 / 5 = 0.44 >= 0.4; step 10's (6..10) is 1.6 / 5 = 0.32 < 0.4
    mismatch = {s: (0.0 if s < ONSET else 0.1 * (s - ONSET + 1)) for s in range(1, 11)}
    alerts = [(3, "attention-spectral", "delta2/entropy", 1, "attention drift"),
              (7, "update-spectral", "entropy", 0, "update: something"),
              (6, "rl", "any_layer_mismatch", None, "routing-mismatch: the training pass routes ...")]
    _monitor(tmp_path / "monitor.jsonl", mismatch, alerts, repeats={1: 0.5, 2: 0.25})  # steps 3.. log none
    s = summarize(tmp_path / "monitor.jsonl", rewards, ONSET)
    assert s["duplicate_share"] == pytest.approx(0.375)
    assert s["alerts"] == 3 and s["early_alerts"] == 1 and s["routing_alerts"] == 1
    assert s["first"]["step"] == 6 and s["first_routing"]["family"] == "rl"
    assert s["mismatch_before"] == 0.0
    assert s["mismatch_after"] == pytest.approx(sum(0.1 * k for k in range(1, 7)) / 6)
    assert s["mismatch_after_max"] == pytest.approx(0.6)
    assert s["reward_before"] == pytest.approx(0.8) and s["reward_end"] == pytest.approx(0.32)
    assert s["collapse"] == 10 and s["iterations"] == 10
    noise = FaultRun("noise-original", "original", f"rollout-router-noise:start={ONSET},std=0.5")
    assert verdict(noise, s) == "MISS: 1 alert(s) before the onset"
    lr = FaultRun("lr-original", "original", f"lr-spike:start={ONSET},x=50")
    assert verdict(lr, s).startswith("MISS")
    r3 = FaultRun("noise-original-r3", "original", noise.fault, r3=True)
    assert "expert mismatch 0.6" in verdict(r3, s) and "routing-mismatch alert under R3" in verdict(r3, s)
    text = table([(noise, s, {"ranks": 2, "wall_s": 123.4})], ONSET)
    row = text.splitlines()[2]
    assert row.startswith("| noise-original | original (2) | rollout-router-noise:start=5,std=0.5 | off | "
                          "6: rl/any_layer_mismatch (routing-mismatch) | 0 | 6 (rl/any_layer_mismatch) | 1 | 0.0000 / 0.3500 (0.6000) | "
                          "0.800 / 0.320 | yes, at 10 | 0.38 | routing-mismatch alert | MISS: 1 alert(s) before the onset")
    assert row.endswith("| 123 |")


def test_verdicts_met_and_missed(tmp_path):
    """Healthy: no alert; the rollout fault: a routing alert and mismatch; under R3: mismatch exactly 0; a
    trainer-side fault: any alert from the onset. Each expectation is met and missed once."""
    def summary(mismatch, alerts):
        _monitor(tmp_path / "m.jsonl", mismatch, alerts)
        return summarize(tmp_path / "m.jsonl", {s: 0.5 for s in mismatch}, ONSET)

    quiet = summary({s: 0.0 for s in range(1, 9)}, [])
    routed = summary({s: (0.3 if s >= ONSET else 0.0) for s in range(1, 9)},
                     [(6, "rl", "any_layer_mismatch", None, "routing-mismatch: x")])
    spectral = summary({s: 0.0 for s in range(1, 9)}, [(7, "update-spectral", "entropy", 1, "update: x")])
    healthy = FaultRun("healthy", "original")
    noise = FaultRun("n", "proxy", "rollout-router-noise:start=5")
    noise_r3 = FaultRun("n3", "proxy", "rollout-router-noise:start=5", r3=True)
    lr = FaultRun("l", "original", "lr-spike:start=5,x=50", r3=True)
    assert verdict(healthy, quiet) == "met" and verdict(healthy, spectral) == "MISS: 1 alert(s) on the healthy run"
    assert verdict(noise, routed) == "met"
    assert verdict(noise, quiet) == "MISS: no routing-mismatch alert; no expert mismatch from the onset"
    assert verdict(noise_r3, quiet) == "met" and verdict(noise_r3, routed).startswith("MISS: expert mismatch 0.3")
    assert verdict(lr, spectral) == "met" and verdict(lr, quiet) == "MISS: no alert from the onset"
    # the same alert on the healthy run (family, metric, layer; any step) is not the fault's
    _monitor(tmp_path / "m.jsonl", {s: 0.0 for s in range(1, 9)},
             [(7, "update-spectral", "entropy", 1, "update: x")])
    like = summarize(tmp_path / "m.jsonl", {s: 0.5 for s in range(1, 9)}, ONSET,
                     healthy=[{"step": 3, "family": "update-spectral", "metric": "entropy", "layer": 1}])
    assert like["first"] is None and like["healthy_like"] == 1 and like["early_alerts"] == 0
    assert verdict(lr, like) == "MISS: no alert from the onset (only 1 like the healthy run's)"
    assert quiet["collapse"] is None
    failed = {**routed, "error": "[rank1]: RuntimeError: boom"}
    assert verdict(noise, failed) == "MISS: the run failed after 8 iterations: [rank1]: RuntimeError: boom"
    assert [healthy.expectation(), noise.expectation(), noise_r3.expectation(), lr.expectation()] == [
        "no alert", "routing-mismatch alert", "no mismatch (R3)", "an alert"]


@pytest.mark.parametrize("value", ["0", "-5"])
def test_run_timeout_must_be_positive(tmp_path, value):
    """`--run-timeout 0` would kill every launch at once and record it as a miss: refused in one line, exit 2,
    before any checkout is looked for or any folder made."""
    from mindspeed_proxy.testing import run_python

    work = tmp_path / "work"
    proc = run_python(["examples/megatron_rl_faults.py", "--work-dir", str(work), "--run-timeout", value],
                      cwd=str(REPO), timeout=120)
    assert proc.returncode == 2 and f"--run-timeout {float(value):g}: must be a positive" in proc.stderr, proc.stderr
    assert not work.exists()


def test_the_example_runs_its_stages_in_its_work_dir_and_records_a_timeout(tmp_path):
    """examples/megatron_rl_faults.py's `run` (through experiments.matrix.launch): the command runs in the given
    folder with its output in the log; past the timeout it is killed and its code is TIMED_OUT, not an exit."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("megatron_rl_faults_example", REPO / "examples" / "megatron_rl_faults.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    log = tmp_path / "stage.log"
    wall, rc = example.run([sys.executable, "-c", "import os; print(os.getcwd())"], str(log), str(tmp_path), {})
    assert rc == 0 and wall > 0 and log.read_text() == f"{tmp_path}\n"
    wall, rc = example.run([sys.executable, "-c", "import time; time.sleep(30)"], str(log), str(tmp_path), {},
                           check=False, timeout=1)
    assert rc == example.TIMED_OUT == 124 and wall < 20 and "TimeoutError: no exit after 1 s" in log.read_text()
