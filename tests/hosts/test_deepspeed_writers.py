"""The mechanism monitor on DeepSpeed writes to the engine's own TensorBoard writer by default: a DeepSpeed config with
a `"tensorboard"` block and a `"mechanism_monitor"` block that names no sinks puts the monitor's tags in DeepSpeed's
event file (1 gloo rank, ZeRO-1, the tiny Qwen3-MoE of test_deepspeed_monitor.py)."""
import json

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e '.[deepspeed]')")
pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install -e '.[tensorboard]')")

from mindspeed_proxy.testing import run_distributed  # noqa: E402
from test_deepspeed_monitor import MONITOR, STEPS, ds_config, init_gloo, tiny_model, train_steps  # noqa: E402


def _train_with_tensorboard(folder):
    import deepspeed

    from mindspeed_proxy.hosts.deepspeed import attach_monitor

    init_gloo()
    config = ds_config(1)
    config["tensorboard"] = {"enabled": True, "output_path": folder, "job_name": "ds"}
    config["mechanism_monitor"] = {k: v for k, v in MONITOR.items() if k != "sinks"} | {"output_dir": f"{folder}/mon"}
    model = tiny_model()
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    monitor = attach_monitor(engine, config)
    train_steps(engine, monitor, 0)
    monitor.close()
    engine.destroy()


def test_monitor_tags_in_deepspeed_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_distributed(_train_with_tensorboard, 1, str(tmp_path), timeout=300)
    acc = EventAccumulator(str(tmp_path / "ds"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"mechanism/router/entropy/layer_1", "mechanism/update-spectral/linear_qkv/entropy/mean"} <= tags
    records = [json.loads(line) for line in open(tmp_path / "mon" / "monitor.jsonl")]
    router = [r for r in records if r["type"] == "sample" and r["family"] == "router"]
    entropy = {e.step: e.value for e in acc.Scalars("mechanism/router/entropy/layer_1")}
    assert sorted(entropy) == [r["step"] for r in router] == list(range(2, STEPS + 1, 2))
    for r in router:
        assert entropy[r["step"]] == pytest.approx(r["layers"]["1"]["entropy"], rel=1e-6)
    assert records[0]["tensorboard_dir"] == str((tmp_path / "ds").resolve())
