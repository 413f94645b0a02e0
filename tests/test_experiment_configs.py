"""The experiment YAMLs load through typed schemas: every shipped file loads, a typo or a mistyped value is one
line naming the file and the key."""
from pathlib import Path

import pytest

from mindspeed_proxy.experiments.config import FaultMatrix, Model, build, check
from mindspeed_proxy.experiments.matrix import load_config
from mindspeed_proxy.experiments.rl_matrix import load_rl_config
from mindspeed_proxy.monitor.config import MonitorConfig

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"


def load_agent_config(path):
    """A train_rl.py --langrl-env-config: every entry is what megatron_agents.env_config writes for its args."""
    import yaml

    from mindspeed_proxy.rl.megatron_agents import env_config

    entries = yaml.safe_load(Path(path).read_text())
    assert entries and all(
        [entry] == env_config(**{k: v for k, v in entry["agent_args"].items() if k != "env_id"}) for entry in entries)


LOADERS = {"fault_matrix.yaml": lambda p: [load_config(p, m) for m in ("quick", "full")],
           "rl_fault_matrix.yaml": load_rl_config, "megatron_rl_fault_matrix.yaml": load_rl_config,
           "megatron_rl_digits.yaml": load_agent_config}


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_yaml_loads_through_its_typed_config(name):
    path = CONFIGS / name
    if name in LOADERS:
        LOADERS[name](path)
    else:
        assert isinstance(MonitorConfig.from_file(str(path)), MonitorConfig)


@pytest.mark.parametrize("name, old, new, message", [
    ("fault_matrix.yaml", "loss_window: 10", "loss_windw: 10",
     "fault_matrix.yaml: divergence.loss_windw: unknown key (known: warmup, loss_factor, grad_factor, loss_window, persistence)"),
    ("fault_matrix.yaml", "original: {ranks: 2,", 'original: {ranks: "2",',
     "fault_matrix.yaml: original.ranks: expected int, got '2'"),
    ("fault_matrix.yaml", "quick: {}", "quick: {runs: {iters: 5}}", "fault_matrix.yaml: modes.quick.runs: unknown key"),
    ("fault_matrix.yaml", "full: {run: {iters: 400,", "full: {run: {iters: four,",
     "fault_matrix.yaml: modes.full.run.iters: expected int, got 'four'"),
    ("rl_fault_matrix.yaml", "onset: 20", "onest: 20", "rl_fault_matrix.yaml: onest: unknown key"),
    ("rl_fault_matrix.yaml", "heldout_seeds: [3, 4, 5]", "heldout_seeds: [3, x, 5]",
     "rl_fault_matrix.yaml: heldout_seeds[1]: expected int, got 'x'"),
    ("rl_fault_matrix.yaml", "false_alarms_per_1000_steps: 5.0", "false_alarms_per_1000_steps: often",
     "rl_fault_matrix.yaml: false_alarms_per_1000_steps: expected float, got 'often'"),
    ("megatron_rl_fault_matrix.yaml", "  sft_docs: 20000", "  sft_doc: 20000",
     "megatron_rl_fault_matrix.yaml: megatron.sft_doc: unknown key"),
    ("megatron_rl_fault_matrix.yaml", "run_timeout_s: 900", "run_timeout_s: long",
     "megatron_rl_fault_matrix.yaml: megatron.run_timeout_s: expected float, got 'long'"),
])
def test_a_typo_or_a_mistyped_value_names_the_file_and_the_key(tmp_path, name, old, new, message):
    text = (CONFIGS / name).read_text()
    assert old in text
    path = tmp_path / name
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(ValueError) as exc:
        LOADERS[name](path)
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value), str(exc.value)


def test_missing_keys_are_named():
    with pytest.raises(ValueError, match="^train_args: missing$"):
        build(FaultMatrix, {})
    with pytest.raises(ValueError, match=r"^original: expected a mapping \(Model\), got 3$"):
        check(3, Model, "original")
