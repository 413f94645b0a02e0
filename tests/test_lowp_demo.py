"""The patches issue's acceptance run: faulted vs healthy tiny MoE through `-m mindspeed_proxy.run`, 2 ranks, EP=2.

Same seed, data and steps; the faulted run injects lowp-attention (2 mantissa bits, toward-zero, rounding
S, P̄ and P̄V) from step 180. Expected: all three families sampled in both runs, no alert on the
healthy run, at least one alert on the faulted run, from the attention/update-spectral families only.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAULT = "lowp-attention:start=180,bits=2,rounding=toward-zero,targets=s+p+pv"


def launch(log_dir: Path, port: int, fault: str | None) -> subprocess.Popen:
    """Start one run of the documented command in the background."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "-m", "mindspeed_proxy.run", str(REPO / "examples" / "train_moe.py"), "--expert-model-parallel-size",
           "2", "--train-iters", "400", "--log-interval", "100", "--log-dir", str(log_dir),
           "--enable-mechanism-monitor", "--mechanism-monitor-config",
           str(REPO / "examples" / "configs" / "lowp_attention_demo.yaml")]
    if fault:
        cmd += ["--inject-fault", fault]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def records(log_dir: Path) -> list[dict]:
    """The monitor's JSONL records of a run."""
    return [json.loads(line) for line in open(log_dir / "mechanism_monitor" / "monitor.jsonl")]


def test_faulted_run_alerts_and_healthy_run_does_not(tmp_path):
    from mindspeed_proxy.testing import free_port

    runs = {"healthy": launch(tmp_path / "healthy", free_port(), None),
            "faulty": launch(tmp_path / "faulty", free_port(), FAULT)}
    for name, proc in runs.items():
        output, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name}:\n{output[-3000:]}"
    healthy, faulty = records(tmp_path / "healthy"), records(tmp_path / "faulty")
    for recs in (healthy, faulty):
        assert {r["family"] for r in recs if r["type"] == "sample"} == {"attention-spectral", "update-spectral",
                                                                       "router"}
    assert [r for r in healthy if r["type"] == "alert"] == []
    alerts = [r for r in faulty if r["type"] == "alert"]
    assert alerts, "the faulted run raised no alert"
    assert {a["family"] for a in alerts} <= {"attention-spectral", "update-spectral"}
    assert all(a["step"] > 180 for a in alerts)
    assert any(r["type"] == "faults" and r["faults"][0]["name"] == "lowp-attention" for r in faulty)
