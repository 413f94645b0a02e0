"""Defaults users expect (issue 37 items 1, 3, 4), on our trainer (1 rank, tiny MoE, real megatron-core):

- with `--tensorboard-dir` and a monitor config that does not name `sinks`, the monitor's scalars are in the event
  file beside the trainer's own;
- a monitor output folder holds one run: a resume appends and is read as one run equal to the uninterrupted one
  (`replay`), a new run (or a load of another run's checkpoint) into that folder is refused in one line before
  training and leaves the file as it was, and the readers refuse a file holding two runs, naming the line;
- `report` reads a monitor output folder without metrics.jsonl (the Megatron-LM layout), the loss from TensorBoard.
"""
import json
import shutil

import pytest

from mindspeed_proxy.report.cli import main as report_main
from mindspeed_proxy.report.replay_cli import main as replay_main
from mindspeed_proxy.report.runs import RunError, load_run
from mindspeed_proxy.testing import run_distributed
from mindspeed_proxy.training.loop import train

# no `sinks` key: the defaults decide where the scalars go; fault after the resume point so that alerts follow it
CONFIG = {"interval": 2, "delta": 2, "router_interval": 2, "qk_gram_reuse": 0,
          "detector": {"warmup": 2, "persistence": 1}, "router_detector": {"warmup": 2, "persistence": 1}}
BASE = ["--num-layers", "2", "--lr-warmup-iters", "2", "--log-interval", "4", "--enable-mechanism-monitor",
        "--inject-fault", "lr-spike:start=6,x=40"]
STEPS, CKPT = 8, 4


def _train(config, *extra):
    assert run_distributed(train, 1, BASE + ["--mechanism-monitor-config", str(config), *extra],
                           timeout=300)[0] in (0, None)


def _records(path):
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`run`: 8 steps with --tensorboard-dir and checkpoints at 4 and 8, copied as `uninterrupted`; then its tracker
    set back to 4 (as if it had died before saving again: its monitor.jsonl holds steps 5-8 written after that
    checkpoint) and resumed from 4 into the same folders. `other`: another run, 4 steps, sinks without tensorboard."""
    root = tmp_path_factory.mktemp("folders")
    (root / "monitor.json").write_text(json.dumps(CONFIG))
    (root / "jsonl_only.json").write_text(json.dumps({**CONFIG, "sinks": ["jsonl"]}))
    run, other = root / "run", root / "other"
    common = ["--log-dir", str(run / "logs"), "--mechanism-monitor-output", str(run / "mon"), "--tensorboard-dir",
              str(run / "tb")]
    _train(root / "monitor.json", "--train-iters", str(STEPS), *common, "--save", str(run / "ckpt"),
           "--save-interval", str(CKPT))
    shutil.copytree(run, root / "uninterrupted", ignore=shutil.ignore_patterns("ckpt"))
    (run / "ckpt" / "latest_checkpointed_iteration.txt").write_text(str(CKPT))
    _train(root / "monitor.json", "--train-iters", str(STEPS), *common, "--load", str(run / "ckpt"))
    _train(root / "jsonl_only.json", "--train-iters", "4", "--log-dir", str(other), "--tensorboard-dir",
           str(other / "tb"))
    return {"root": root, "run": run, "uninterrupted": root / "uninterrupted", "other": other}


def test_tensorboard_dir_gets_the_monitor_scalars_by_default(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    full = runs["uninterrupted"]
    acc = EventAccumulator(str(full / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "mechanism/router/entropy/layer_0", "mechanism/router/entropy/mean",
            "mechanism/update-spectral/linear_qkv/entropy/layer_1",
            "mechanism/attention-spectral/delta2/entropy/mean"} <= tags
    records = _records(full / "mon" / "monitor.jsonl")
    assert records[0]["config"]["sinks"] == ["jsonl", "tensorboard", "wandb"]
    assert records[0]["tensorboard_dir"] == str((runs["run"] / "tb").resolve())
    router = [r for r in records if r["type"] == "sample" and r["family"] == "router"]
    entropy = {e.step: e.value for e in acc.Scalars("mechanism/router/entropy/layer_1")}
    assert sorted(entropy) == [r["step"] for r in router] == list(range(2, STEPS + 1, 2))
    for r in router:
        assert entropy[r["step"]] == pytest.approx(r["layers"]["1"]["entropy"], rel=1e-6)
    alerts = [r for r in records if r["type"] == "alert"]
    assert alerts, "the lr spike must raise alerts, or the markers show nothing"
    markers = {}
    for family in {a["family"] for a in alerts}:
        for e in acc.Scalars(f"mechanism/{family}/alerts/count"):
            markers[(family, e.step)] = e.value
    expected = {}
    for a in alerts:
        expected[(a["family"], a["step"])] = expected.get((a["family"], a["step"]), 0) + 1
    assert markers == expected
    assert "mechanism/alerts/text_summary" in acc.Tags()["tensors"]


def test_sinks_without_tensorboard_keep_the_monitor_out_of_the_event_file(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs["other"] / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert "train/loss" in tags and not any(t.startswith("mechanism/") for t in tags)
    records = _records(runs["other"] / "mechanism_monitor" / "monitor.jsonl")
    assert "tensorboard_dir" not in records[0] and records[-1]["type"] == "sample"


def test_resume_is_read_as_the_uninterrupted_run(runs, capsys):
    full, resumed = runs["uninterrupted"] / "mon", runs["run"] / "mon"
    records = _records(resumed / "monitor.jsonl")
    configs = [r for r in records if r["type"] == "config"]
    assert len(configs) == 2 and configs[0]["run_id"] == configs[1]["run_id"] and configs[1]["resumed_from"] == CKPT
    written = [r["step"] for r in records if r["type"] == "sample" and r["family"] == "router"]
    assert written == [2, 4, 6, 8, 6, 8]  # 6 and 8 twice: the first launch's, after its checkpoint, and again
    a, b = load_run(full), load_run(resumed)
    assert b.samples == a.samples and b.alerts == a.alerts and a.alerts
    assert [s["step"] for s in b.samples["router"]] == list(range(2, STEPS + 1, 2))
    assert any(a["step"] > CKPT for a in b.alerts)
    assert replay_main([str(full), "--json"]) == 0
    uninterrupted = capsys.readouterr().out
    assert replay_main([str(resumed), "--json"]) == 0
    assert capsys.readouterr().out == uninterrupted and uninterrupted.strip()


def test_another_run_into_the_folder_is_refused_before_training(runs, capfd):
    """A new run (no --load) into `other`'s folder, and a load of `run`'s checkpoint (another lineage) into it."""
    other = runs["other"]
    monitor = other / "mechanism_monitor" / "monitor.jsonl"
    before, metrics = monitor.read_text(), (other / "metrics.jsonl").read_text()
    for extra, why in (([], "this launch does not resume it"),
                       (["--load", str(runs["run"] / "ckpt")], "the loaded checkpoint is of run")):
        with pytest.raises(Exception, match="SystemExit: 2"):
            _train(runs["root"] / "jsonl_only.json", "--train-iters", str(STEPS + 2), "--log-dir", str(other), *extra)
        lines = [line for line in capfd.readouterr().err.splitlines() if "mechanism monitor:" in line]
        assert len(lines) == 1 and f"{monitor} already holds run" in lines[0] and why in lines[0], lines
        assert monitor.read_text() == before and (other / "metrics.jsonl").read_text() == metrics  # nothing trained


def test_readers_refuse_a_file_with_two_runs(runs, tmp_path, capsys):
    two = tmp_path / "two"
    two.mkdir()
    first = (runs["uninterrupted"] / "mon" / "monitor.jsonl").read_text()
    (two / "monitor.jsonl").write_text(first + (runs["other"] / "mechanism_monitor" / "monitor.jsonl").read_text())
    second = first.count("\n") + 1
    with pytest.raises(RunError, match=rf"monitor.jsonl:{second}: a second run starts here"):
        load_run(two)
    assert replay_main([str(two)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"monitor.jsonl:{second}: a second run starts here" in err[0]


def test_report_on_a_monitor_folder_takes_the_loss_from_tensorboard(runs, tmp_path):
    mon = tmp_path / "mon"
    shutil.copytree(runs["uninterrupted"] / "mon", mon)  # the Megatron-LM layout: monitor.jsonl, no metrics.jsonl
    assert report_main([str(mon), "--out", str(tmp_path / "report")]) == 0
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    metrics = _records(runs["uninterrupted"] / "logs" / "metrics.jsonl")[1:]
    assert summary["steps"] == STEPS and summary["loss_source"].startswith("TensorBoard")
    run = load_run(mon)
    assert run.loss == pytest.approx([m["loss"] for m in metrics], rel=1e-6)
    assert set(summary["families"]) == {"attention-spectral", "update-spectral", "router"}
    assert {"loss_grad_norm.png", "router_aggregate.png"} <= set(summary["plots"])
    assert summary["alerts"] == len(run.alerts) > 0
