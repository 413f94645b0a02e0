"""examples/experiments/rl_fault_matrix.py with the train_rl.py config, tiny: Megatron-LM's preprocess_data.py and
pretrain_gpt.py SFT, convert_to_proxy.py, then Megatron-LM's own train_rl.py runs (healthy tuning runs, a held-out
seed's healthy and rollout-noise runs, original on 2 ranks and proxy on 1), calibration, replay and the page,
which a fresh work dir regenerates from the exported raw files alone.
Needs a Megatron-LM checkout (MEGATRON_LM_PATH) and the `rl` extra; skips otherwise (not in CI)."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import yaml

from test_megatron_lm import env, mlm, pytestmark  # noqa: F401  (fixtures, skip reason)
from test_megatron_lm_rl import rl_env  # noqa: F401  (fixture: skips without the rl extra)

REPO = Path(__file__).resolve().parents[1]
ITERS, ONSET = 8, 5


def _tiny(tmp: Path) -> Path:
    """The shipped config shrunk: 2 tuning runs per model (R = 100 per 1000 steps, so that k >= 1), one held-out
    seed, a 30-iteration SFT, 8-iteration runs, the detectors' warm-up shortened to fit."""
    configs = REPO / "examples" / "configs"
    for name, out in (("rl_fault_matrix_monitor.yaml", "monitor.yaml"),
                      ("megatron_rl_fault_matrix_calibrate.yaml", "calibrate.yaml")):
        cfg = yaml.safe_load((configs / name).read_text())
        cfg.update(detect_start=2, interval=1, delta=1, detector={**cfg["detector"], "warmup": 2})
        if "router_detector" in cfg:
            cfg["router_detector"] = {**cfg["router_detector"], "warmup": 2}
        (tmp / out).write_text(yaml.safe_dump(cfg))
    cfg = yaml.safe_load((configs / "megatron_rl_fault_matrix.yaml").read_text())
    cfg["megatron"].update(sft_docs=400, run_timeout_s=900)
    cfg.update(tuning_seeds=[11], heldout_seeds=[12], healthy_rl_seeds={"11": [1101]}, sft_iters=30,
               run_iters=ITERS, onset=ONSET, monitor_config="monitor.yaml", calibrate_config="calibrate.yaml",
               faults={"none": None, "rollout-router-noise": "rollout-router-noise:start={onset},std=2.0"},
               expected_families={"rollout-router-noise": ["rl"]}, false_alarms_per_1000_steps=100.0)
    (tmp / "megatron_rl_tiny.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / "megatron_rl_tiny.yaml"


def test_matrix_runs_train_rl_and_its_page_regenerates_from_the_raw_files(mlm, rl_env, tmp_path):
    config = _tiny(tmp_path)
    cmd = [sys.executable, str(REPO / "examples" / "experiments" / "rl_fault_matrix.py"), "--config", str(config),
           "--megatron-lm", str(mlm), "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "page.md"),
           "--reuse"]
    res = subprocess.run(cmd, env=rl_env, cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    page = (tmp_path / "page.md").read_text()
    assert page.startswith("# RL fault matrix in Megatron-LM's train_rl.py") and "calibration FAILED" not in page
    assert "Megatron-LM's unmodified `train_rl.py`" in page  # the tiny protocol is too small to hold, and says so:
    assert ("- **Conditions.** UNMET: 1 held-out healthy runs × 8 steps = 8 < 1000 steps per model; 1 held-out seeds "
            "per fault < 3") in page
    work = tmp_path / "work"
    runs = {"seed11": ["original_none", "proxy_none", "original_none_s1101", "proxy_none_s1101"],
            "seed12": ["original_none", "proxy_none", "original_rollout-router-noise", "proxy_rollout-router-noise"]}
    for seed, names in runs.items():
        for name in names:
            run = work / seed / "runs" / name
            done = json.loads(Path(str(run) + ".done.json").read_text())["result"]
            assert done["returncode"] == 0 and done["ranks"] == (2 if name.startswith("original") else 1), done
            steps = [json.loads(line) for line in open(run / "metrics.jsonl")]
            assert [s["iteration"] for s in steps] == list(range(1, ITERS + 1))
            assert all(0.0 <= s["reward_mean"] <= 1.0 for s in steps) and not (run.parent / f"{name}.langrl").exists()
            samples = [json.loads(line) for line in open(run / "mechanism_monitor" / "monitor.jsonl")]
            rl = {r["step"]: r["layers"]["all"] for r in samples if r.get("type") == "sample" and r["family"] == "rl"}
            assert sorted(rl) == list(range(1, ITERS + 1)), sorted(rl)
            if "noise" in name:  # the noise acts on the rollout passes only: the experts differ from the onset
                before = max(rl[s]["any_layer_mismatch"] for s in range(1, ONSET))
                assert min(rl[s]["any_layer_mismatch"] for s in range(ONSET, ITERS + 1)) > max(before, 0.05), rl
    for source in ("all", "original", "proxy"):
        assert (work / "calibration" / f"{source}.yaml").is_file()
    raw = tmp_path / "page"
    monitor = raw / "12" / "proxy_rollout-router-noise" / "monitor.jsonl.gz"
    assert any('"family": "rl"' in line for line in gzip.open(monitor, "rt"))
    fresh = [*cmd[:cmd.index("--work-dir") + 1], str(tmp_path / "fresh"), *cmd[cmd.index("--work-dir") + 2:]]
    again = subprocess.run([*fresh, "--tables-only"], env=rl_env, cwd=REPO, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0 and "8 runs imported" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    tables = lambda text: text.split("## Detection")[1].split("## Cost")[0]  # noqa: E731
    assert tables((tmp_path / "page.md").read_text()) == tables(page)
