"""Configuration resolved once and one launcher: typed configs refuse bad values where they are built, nothing is
lowered silently, the launcher's commands reach the same entry points as the scripts, with one error line."""
import os

import pytest

from mindspeed_proxy import cli
from mindspeed_proxy.monitor.config import MonitorConfig
from mindspeed_proxy.rl.update import GRPOConfig


def test_delta_is_derived_when_not_given_and_refused_when_above_the_interval():
    assert MonitorConfig().delta == 100
    assert MonitorConfig(interval=10).delta == 10  # min(100, interval): the API now agrees with the flags
    assert MonitorConfig(interval=250).delta == 100
    with pytest.raises(ValueError, match=r"delta=20 \(δ is never lowered"):
        MonitorConfig(interval=10, delta=20)


def test_a_delta_from_the_file_above_the_flags_interval_is_refused_not_lowered(tmp_path):
    from mindspeed_proxy.monitor.arguments import monitor_config_from_args, monitor_flags_in

    path = tmp_path / "monitor.yaml"
    path.write_text("interval: 100\ndelta: 50\n")
    flags = monitor_flags_in(["--mechanism-monitor-config", str(path), "--mechanism-monitor-interval", "10"])
    with pytest.raises(ValueError, match="interval=10, delta=50"):
        monitor_config_from_args(flags)
    derived = monitor_config_from_args(monitor_flags_in(["--mechanism-monitor-interval", "10"]))
    assert (derived.interval, derived.delta) == (10, 10)
    assert derived.delta == MonitorConfig(interval=10).delta  # flags and API resolve alike


@pytest.mark.parametrize("kwargs, message", [
    (dict(interval="10"), "interval: expected an integer"),
    (dict(families=["routers"]), "families: unknown"),
    (dict(sinks="jsonl"), "sinks: expected a list"),
])
def test_monitor_config_refuses_mistyped_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MonitorConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(group_size=1), "group_size must be an integer >= 2"),
    (dict(iterations=0), "iterations must be an integer >= 1"),
    (dict(kl_beta=-0.1), "kl_beta must be a finite number >= 0"),
    (dict(clamp_eps_lower=1.0), "clamp_eps_lower must be < 1"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(kl_estimator="k4"), "kl_estimator must be one of"),
    (dict(routing_replay="r1"), "routing_replay must be one of"),
    (dict(dual_clip=1.0), "dual_clip must be > 1"),
])
def test_grpo_config_is_validated_where_it_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**kwargs)


def test_grpo_config_of_the_default_flags_equals_the_dataclass_defaults():
    from mindspeed_proxy.rl.arguments import grpo_config, parse

    assert grpo_config(parse([], "x")) == GRPOConfig()


def test_rl_parse_takes_the_world_size_and_never_reads_the_environment(monkeypatch):
    from mindspeed_proxy.rl.arguments import ArgumentError, launch_world_size, parse

    monkeypatch.setenv("WORLD_SIZE", "2")
    parse(["--grpo-prompts-per-step", "3"], "x")  # world=1 unless told: the environment plays no part
    with pytest.raises(ArgumentError, match="not divisible by the data-parallel size 2"):
        parse(["--grpo-prompts-per-step", "3"], "x", world=2)
    assert launch_world_size() == 2
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ArgumentError, match="WORLD_SIZE='two'"):
        launch_world_size()


def test_every_launcher_command_reaches_the_scripts_entry_point():
    import importlib

    for argv, module, function in [
            (["train"], "mindspeed_proxy.training.loop", "train"), (["rl", "sft"], "mindspeed_proxy.rl.sft", "main"),
            (["rl", "train"], "mindspeed_proxy.rl.train", "main"), (["convert"], "mindspeed_proxy.proxy.cli", "main"),
            (["plan"], "mindspeed_proxy.proxy.plan_cli", "main"), (["report"], "mindspeed_proxy.report.cli", "main"),
            (["compare"], "mindspeed_proxy.report.cli", "compare_main"),
            (["replay"], "mindspeed_proxy.report.replay_cli", "main"),
            (["calibrate"], "mindspeed_proxy.report.calibrate_cli", "main"),
            (["patches"], "mindspeed_proxy.patches.__main__", "main")]:
        entry, prog, _, rest = cli.resolve(argv + ["--x"])
        target = getattr(importlib.import_module(module), function)
        assert rest == ["--x"] and prog == "mindspeed-proxy " + " ".join(argv)
        # the entry is the function itself, or a closure over it that only adds prog=
        assert entry is target or target in [c.cell_contents for c in entry.__closure__ or ()], argv


@pytest.mark.parametrize("argv, message", [
    (["rl", "train", "--grpo-group-size", "1"], "mindspeed-proxy rl train: error: --grpo-group-size 1: must be >= 2"),
    (["rl", "sft", "--rl-task", "sudoku"], "mindspeed-proxy rl sft: error: --rl-task 'sudoku': unknown task"),
    (["train", "--num-experts", "3", "--expert-model-parallel-size", "2"],
     "mindspeed-proxy train: error: --num-experts 3 is not divisible by --expert-model-parallel-size 2"),
    (["report", "no-such-run"], "mindspeed-proxy report: error: no-such-run"),
])
def test_launcher_commands_refuse_bad_input_in_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(message), lines
    assert os.listdir(tmp_path) == []  # nothing written


def test_unknown_command_prints_the_usage_and_exits_2(capsys):
    assert cli.main(["rl", "fly"]) == 2
    assert "usage: mindspeed-proxy rl {sft,train}" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0


def test_one_error_helper():
    with pytest.raises(SystemExit) as exc:
        cli.fail("prog", "bad")
    assert exc.value.code == 2
