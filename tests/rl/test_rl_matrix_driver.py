"""End to end: examples/experiments/rl_fault_matrix.py on a tiny config (2 seeds, 1 fault + healthy), then the
page's numbers recomputed from the recorded files, and --reuse resuming a run whose record was lost.
Slow (12 training processes, about 1.5 CPU min): `make test-all` runs it."""
import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--moe-ffn-hidden-size", "32",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--rl-partial-credit", "0.5"]
GRPO = ["--grpo-prompts-per-step", "4", "--grpo-group-size", "4", "--micro-batch-size", "8", "--lr", "1e-3",
        "--min-lr", "1e-3", "--grpo-iterations", "1", "--grpo-kl-beta", "0", "--log-interval", "100"]


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rlmatrix")
    monitor = yaml.safe_load((ROOT / "examples/configs/rl_fault_matrix_monitor.yaml").read_text())
    monitor.update(detect_start=2, detector={**monitor["detector"], "warmup": 3},
                   router_detector={**monitor["router_detector"], "warmup": 3})
    (tmp / "monitor.yaml").write_text(yaml.safe_dump(monitor))
    calib = yaml.safe_load((ROOT / "examples/configs/rl_fault_matrix_calibrate.yaml").read_text())
    calib.update(detect_start=2, detector={**calib["detector"], "warmup": 3})
    (tmp / "calibrate.yaml").write_text(yaml.safe_dump(calib))
    cfg = yaml.safe_load((ROOT / "examples/configs/rl_fault_matrix.yaml").read_text())
    cfg.update(task_args=["--rl-task", "reverse", *TINY], grpo_args=GRPO, tuning_seeds=[1], heldout_seeds=[2],
               sft_iters=12, warmup_rl_iters=2, run_iters=12, onset=8, monitor_config="monitor.yaml",
               original={"num_experts": 8, "expert_parallel": 1, "ranks": 1}, e4_eval_prompts=0,
               faults={"none": None, "lr-spike": "lr-spike:start={onset},x=100"}, r3_controls=[],
               healthy_rl_seeds={"1": [101], "2": [201]}, calibrate_config="calibrate.yaml",
               false_alarms_per_1000_steps=50.0)  # 12-step runs: q = 0.6, S = 3, N = 4 pooled runs suffice
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, str(ROOT / "examples/experiments/rl_fault_matrix.py"), "--config", str(tmp / "cfg.yaml"),
           "--work-dir", str(tmp / "work"), "--out", str(tmp / "page.md"), "--reuse"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return tmp, cmd, first.stdout


def test_page_tables_and_false_alarms_match_the_replayed_records(matrix):
    from mindspeed_proxy.monitor.config import MonitorConfig
    from mindspeed_proxy.report.replay import replay_alerts
    from mindspeed_proxy.report.runs import load_run

    tmp, _, out = matrix
    page = (tmp / "page.md").read_text()
    for heading in ("## Detection before the reward collapse", "## False alarms on the held-out healthy runs",
                    "## The proxy calibrates the original", "## E3: does the proxy reproduce",
                    "## Every held-out run", "## Cost"):
        assert heading in page
    # sections of what this config does not run (no lowp-attention fault, no R3 control, no E4) are left out
    assert "## lowp-attention" not in page and "R3 control" not in page and "## E4" not in page
    calibrated = MonitorConfig.from_file(str(tmp / "work/calibration/all.yaml"))
    # the tuning runs: both models' healthy runs of seed 1 and of its RL seed 101
    assert calibrated.calibration["tuning_runs"] == 4 and calibrated.calibration["false_alarms_per_1000_steps"] == 50.0
    assert sorted(calibrated.calibration["statistics"]) == ["rl/any_layer_mismatch", "rl/topk_match",
                                                          "update-spectral/linear_qkv/frobenius"]
    for model in ("original", "proxy"):  # the held-out healthy runs: seed 2 and its RL seed 201
        runs = [load_run(str(tmp / "work/seed2/runs" / name)) for name in (f"{model}_none", f"{model}_none_s201")]
        alerts = sum(len(replay_alerts(run, calibrated)) for run in runs)
        steps = sum(len(run.steps) for run in runs)
        row = next(line for line in page.splitlines() if line.startswith(f"| {model} | 2 | {steps} |"))
        assert row.split(" | ")[3] == str(alerts)  # runs | count | steps | alerts
    assert "## Protocol (fixed before the runs)" in page and "- **Conditions.** UNMET: " in page
    # the seed is every process's --seed (an extra healthy run's: its RL seed); tuning seeds ran only healthy runs
    stages = json.loads((tmp / "work/results.json").read_text())["stages"]
    assert {k for k in stages if k.startswith("1/")} == {"1/sft", "1/warmup", "1/convert_cluster", "1/original_none",
                                                        "1/proxy_none", "1/original_none_s101", "1/proxy_none_s101"}
    assert all(s["command"][s["command"].index("--seed") + 1] == (k.split("_s")[-1] if "_none_s" in k else
                                                                  k.split("/")[0])
               for k, s in stages.items() if "--seed" in s["command"])
    assert all(s["cpu_s"] > 0 and s["wall_s"] > 0 for s in stages.values())
    # the raw files keep what the tables need: replaying the trimmed monitor.jsonl gives the same alerts
    raw, copy = tmp / "page" / "2" / "original_lr-spike", tmp / "unzipped"
    (copy / "mechanism_monitor").mkdir(parents=True)
    for name, dst in (("metrics.jsonl", copy / "metrics.jsonl"), ("monitor.jsonl", copy / "mechanism_monitor/monitor.jsonl")):
        with gzip.open(raw / f"{name}.gz", "rt") as fh:
            dst.write_text(fh.read())
    full = load_run(str(tmp / "work/seed2/runs/original_lr-spike"))
    assert (copy / "metrics.jsonl").read_text() == (full.path / "metrics.jsonl").read_text()
    assert replay_alerts(load_run(str(copy)), calibrated) == replay_alerts(full, calibrated) != []
    assert re.search(r"this sitting: [\d.]+ min wall", out)


def test_reuse_skips_completed_stages_and_reruns_an_incomplete_one(matrix):
    tmp, cmd, _ = matrix
    (tmp / "work/seed2/runs/proxy_lr-spike.done.json").unlink()  # as if killed half-way
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    again_page = (tmp / "page.md").read_text()
    reused = re.findall(r"\[seed (\d)\] (\S+): reusing", again.stdout)
    ran = re.findall(r"\[seed (\d)\] (\S+): [\d.]+ s wall", again.stdout)
    assert ran == [("2", "proxy_lr-spike")] and len(reused) == 8  # seed 2's other stages
    assert "seed 1: every run recorded (or kept in the repo), nothing to run" in again.stdout
    # the page regenerates from the raw files alone: a fresh work dir imports every run, runs nothing
    fresh = [*cmd[:cmd.index("--work-dir") + 1], str(tmp / "fresh"), *cmd[cmd.index("--work-dir") + 2:]]
    rebuilt = subprocess.run(fresh, capture_output=True, text=True, timeout=600)
    assert rebuilt.returncode == 0 and "s wall," not in rebuilt.stdout, rebuilt.stderr[-3000:]
    assert "10 runs imported" in rebuilt.stdout  # seed 1: 2 models x (none, s101); seed 2: x (none, s201, lr-spike)
    tables = lambda page: page.split("## Detection")[1].split("## Cost")[0]  # noqa: E731
    assert tables((tmp / "page.md").read_text()) == tables(again_page)
    tables = subprocess.run([*cmd, "--tables-only", "--seeds", "2"], capture_output=True, text=True, timeout=600)
    assert tables.returncode == 0 and "reusing" not in tables.stdout and "s wall," not in tables.stdout
    sittings = json.loads((tmp / "work/sittings.json").read_text())  # the two that ran stages, not --tables-only
    assert [x["seeds"] for x in sittings] == [[1, 2], [1, 2]] and all(x["wall_s"] > 0 for x in sittings)
    bad = subprocess.run([*cmd, "--seeds", "9"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--seeds: [9] not in" in bad.stderr
