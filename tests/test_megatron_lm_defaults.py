"""Megatron-LM's own `pretrain_gpt.py` (through `mindspeed_proxy.run`) with only `--tensorboard-dir` and
`--enable-mechanism-monitor`: the monitor's scalars land in Megatron-LM's event file by default, `report` reads the
monitor folder (no metrics.jsonl) with the loss from that event file, and a second run into the same monitor folder
is refused in one line before training.

Needs MEGATRON_LM_PATH (a core_v0.16 checkout; see tests/test_megatron_lm.py and docs/megatron_lm.md); skips
with that reason without it.
"""
from __future__ import annotations

import json

import pytest

from test_megatron_lm import _launch, _losses, env, mlm, pytestmark  # noqa: F401  (fixtures, skip reason)

MONITOR = ("--enable-mechanism-monitor", "--mechanism-monitor-interval", "5", "--mechanism-monitor-delta", "5")


@pytest.fixture(scope="module")
def run(mlm, env, tmp_path_factory):
    """20 steps, EP=2 on 2 gloo ranks, --tensorboard-dir, no monitor config (so no sinks named)."""
    cwd = tmp_path_factory.mktemp("mlm_defaults")
    res = _launch(mlm, env, cwd, *MONITOR, "--mechanism-monitor-output", str(cwd / "mon"),
                  "--tensorboard-dir", str(cwd / "tb"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return cwd, res


def _records(path):
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


def test_monitor_scalars_in_megatron_lm_event_file_by_default(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cwd, _ = run
    acc = EventAccumulator(str(cwd / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert "lm loss" in tags  # Megatron-LM's own writer
    assert {"mechanism/router/entropy/layer_0", "mechanism/router/entropy/mean",
            "mechanism/update-spectral/linear_qkv/entropy/layer_1",
            "mechanism/attention-spectral/delta2/entropy/mean"} <= tags
    records = _records(cwd / "mon" / "monitor.jsonl")
    assert records[0]["tensorboard_dir"] == str((cwd / "tb").resolve())
    spectral = [r for r in records if r["type"] == "sample" and r["family"] == "update-spectral"]
    entropy = {e.step: e.value for e in acc.Scalars("mechanism/update-spectral/linear_qkv/entropy/layer_1")}
    assert sorted(entropy) == [r["step"] for r in spectral] == [5, 10, 15, 20]
    for r in spectral:
        assert entropy[r["step"]] == pytest.approx(r["layers"]["1"]["linear_qkv"]["entropy"], rel=1e-6)


def test_report_on_the_megatron_lm_monitor_folder(run):
    from mindspeed_proxy.report.cli import main as report_main
    from mindspeed_proxy.report.runs import load_run

    cwd, res = run
    assert not (cwd / "mon" / "metrics.jsonl").exists()
    assert report_main([str(cwd / "mon"), "--out", str(cwd / "report")]) == 0
    summary = json.loads((cwd / "report" / "summary.json").read_text())
    assert summary["steps"] == 20 and "'lm loss'" in summary["loss_source"]
    assert set(summary["families"]) == {"attention-spectral", "update-spectral", "router"}
    assert {"loss_grad_norm.png", "router_heatmap.png", "update_spectral_aggregate.png"} <= set(summary["plots"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(cwd / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    loaded = load_run(cwd / "mon")
    assert loaded.loss == [e.value for e in acc.Scalars("lm loss")] and loaded.steps == list(range(1, 21))
    logged = _losses(res.stdout + res.stderr)  # Megatron-LM's log line, 6 significant digits
    assert sorted(logged) == loaded.steps
    # the printed value at iteration 2 is the mean of iterations 1 and 2 (Megatron-LM's first logging window);
    # the event file holds each iteration's own loss
    assert float(logged[2]) == pytest.approx((loaded.loss[0] + loaded.loss[1]) / 2, rel=1e-5)
    assert loaded.loss[2:] == pytest.approx([float(logged[s]) for s in loaded.steps[2:]], rel=1e-5)


def test_second_run_into_the_folder_is_refused_before_training(mlm, env, run):
    cwd, _ = run
    monitor = cwd / "mon" / "monitor.jsonl"
    before = monitor.read_text()
    res = _launch(mlm, env, cwd, *MONITOR, "--mechanism-monitor-output", str(cwd / "mon"))
    assert res.returncode != 0
    lines = [line for line in res.stderr.splitlines() if "mechanism monitor:" in line]
    assert len(lines) == 1 and lines[0].startswith("mindspeed-proxy: mechanism monitor: "), res.stderr[-3000:]
    assert f"{monitor} already holds run" in lines[0] and "does not resume it" in lines[0]
    assert not _losses(res.stdout + res.stderr)  # no step was trained
    assert monitor.read_text() == before
