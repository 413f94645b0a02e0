"""MonitorConfig loading, sinks and monitor state round trip."""
import csv
import json

import pytest

from mindspeed_proxy.monitor import MonitorConfig
from mindspeed_proxy.monitor.sinks import CsvSink, JsonlSink, WriterSink, build_sinks, scalar_tags
from mindspeed_proxy.testing import run_distributed


def test_config_from_yaml_and_json(tmp_path):
    (tmp_path / "m.yaml").write_text("interval: 50\ndelta: 10\ndetector:\n  z_threshold: 6.0\n  warmup: 20\n")
    cfg = MonitorConfig.from_file(str(tmp_path / "m.yaml"))
    assert (cfg.interval, cfg.delta, cfg.detector.z_threshold, cfg.detector.warmup) == (50, 10, 6.0, 20)
    (tmp_path / "m.json").write_text(json.dumps(cfg.to_dict()))
    assert MonitorConfig.from_file(str(tmp_path / "m.json")) == cfg


@pytest.mark.parametrize("data,message", [
    ({"intervall": 5}, "unknown monitor config keys: ['intervall']"),
    ({"interval": 10, "delta": 20}, "1 ≤ delta ≤ interval"),
    ({"qk_terms": ["delta4"]}, "qk_terms"),
    ({"sinks": ["stdout"]}, "sinks"),
    ({"detect_scopes": {"router": ["median"]}}, "detect_scopes"),
    ({"detector": {"z_threshold": "high"}}, "z_threshold"),
])
def test_config_errors_name_the_key(data, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        MonitorConfig.from_dict(data)


def test_detection_series_per_layer_and_layer_mean():
    per_layer = {"entropy": {0: 1.0, 1: 2.5, 3: 3.5}, "margin": {0: 9.0}}
    cfg = MonitorConfig(detect_metrics={"router": ["entropy"]})
    assert cfg.detection_series("router", per_layer) == {("router", "entropy", i, None): v
                                                        for i, v in per_layer["entropy"].items()}
    cfg.detect_scopes = {"router": ["mean"]}
    assert cfg.detection_series("router", per_layer) == {("router", "entropy", None, None): 7.0 / 3}
    cfg.detect_scopes = {"router": ["layer", "mean"]}
    assert len(cfg.detection_series("router", per_layer)) == 4
    update = {"linear_qkv/entropy": {0: 1.0, 1: 2.0}, "router/entropy": {0: 5.0}, "linear_qkv/frobenius": {0: 3.0}}
    cfg = MonitorConfig(detect_scopes={"update-spectral": ["mean"]})  # default slots: linear_qkv, linear_proj
    assert cfg.detection_series("update-spectral", update) == {("update-spectral", "linear_qkv/entropy", None, None): 1.5}


def test_snapshot_and_sample_schedule():
    cfg = MonitorConfig(interval=10, delta=3)
    assert [s for s in range(1, 31) if cfg.snapshot_step(s)] == [7, 17, 27]
    assert [s for s in range(1, 31) if cfg.sample_step(s)] == [10, 20, 30]


def test_scalar_tags_aggregate_over_layers():
    tags = scalar_tags("router", {"entropy": {0: 1.0, 3: 2.0, 5: float("nan")}})
    assert tags["mechanism/router/entropy/layer_3"] == 2.0
    assert tags["mechanism/router/entropy/mean"] == 1.5
    assert (tags["mechanism/router/entropy/min"], tags["mechanism/router/entropy/max"]) == (1.0, 2.0)
    # a value of no single layer (the rl family's layer None) is `all`, outside the aggregates
    tags = scalar_tags("rl", {"topk_match": {0: 0.5, 1: 0.7, None: 0.9}, "entropy": {None: 2.0}})
    assert tags["mechanism/rl/topk_match/all"] == 0.9 and tags["mechanism/rl/entropy/all"] == 2.0
    assert tags["mechanism/rl/topk_match/mean"] == pytest.approx(0.6)
    assert not any(t.startswith("mechanism/rl/entropy/") and t != "mechanism/rl/entropy/all" for t in tags)


def test_jsonl_and_csv_sinks(tmp_path):
    jsonl, table = JsonlSink(str(tmp_path / "a.jsonl")), CsvSink(str(tmp_path / "a.csv"))
    jsonl.write({"type": "sample", "value": float("nan"), "layers": {"0": {"x": float("inf")}}})
    table.scalars(7, {"mechanism/router/entropy/layer_0": 0.5})
    jsonl.close()
    table.close()
    assert json.loads((tmp_path / "a.jsonl").read_text()) == {"type": "sample", "value": None,
                                                              "layers": {"0": {"x": None}}}
    rows = list(csv.reader(open(tmp_path / "a.csv")))
    assert rows == [["step", "tag", "value"], ["7", "mechanism/router/entropy/layer_0", "0.5"]]


class FakeTensorBoard:
    """Records what a SummaryWriter would receive."""

    def __init__(self):
        self.scalars, self.texts = [], []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def add_text(self, tag, text, step):
        self.texts.append((tag, text, step))


class FakeWandb:
    """Records what wandb.log would receive."""

    def __init__(self):
        self.logged = []

    def log(self, data, step):
        self.logged.append((data, step))


def test_writer_sinks_for_tensorboard_and_wandb(tmp_path):
    tb, wb = FakeTensorBoard(), FakeWandb()
    sinks = build_sinks(["jsonl", "tensorboard", "wandb"], str(tmp_path), tb, wb)
    assert [type(s) for s in sinks] == [JsonlSink, WriterSink, WriterSink]
    for sink in sinks:
        sink.scalars(3, {"mechanism/update-spectral/linear_qkv/entropy/layer_0": 1.25, "bad": float("nan")})
        sink.write({"type": "alert", "step": 3, "family": "router"})
    assert tb.scalars == [("mechanism/update-spectral/linear_qkv/entropy/layer_0", 1.25, 3)]
    assert tb.texts and tb.texts[0][0] == "mechanism/alerts"
    alert_text = '{"type": "alert", "step": 3, "family": "router"}'
    assert wb.logged == [({"mechanism/update-spectral/linear_qkv/entropy/layer_0": 1.25}, 3),
                         ({"mechanism/alerts": alert_text}, 3)]
    for sink in sinks[1:]:  # a second alert of the family at step 3: the marker counts both, written once
        sink.write({"type": "alert", "step": 3, "family": "router"})
        sink.close()
    assert tb.scalars[1:] == [("mechanism/router/alerts/count", 2, 3)]
    assert wb.logged[-1] == ({"mechanism/router/alerts/count": 2}, 3)
    assert build_sinks(["tensorboard"], str(tmp_path)) == []  # no writer, no sink


def state_round_trip(steps):
    """Train with the monitor, save its state through JSON, restore into a fresh monitor."""
    from mindspeed_proxy.monitor import MechanismMonitor
    from mindspeed_proxy.testing.batches import synthetic_microbatches
    from mindspeed_proxy.testing.parallel import init_parallel
    from mindspeed_proxy.testing.routing import routed_to
    from mindspeed_proxy.tiny_moe import TinyMoEConfig
    from mindspeed_proxy.training.engine import TrainConfig, Trainer, microbatch_sample_ids

    init_parallel()
    model_cfg, train_cfg = TinyMoEConfig(num_layers=2), TrainConfig(micro_batch_size=2, global_batch_size=4)
    trainer = Trainer(model_cfg, train_cfg)
    config = MonitorConfig(interval=2, delta=1, router_interval=2, sinks=[])
    monitor = MechanismMonitor(config, trainer.model, trainer.optimizer)
    trainer.monitor = monitor
    with routed_to(monitor):
        for it in range(steps):
            trainer.train_step(synthetic_microbatches(microbatch_sample_ids(train_cfg, it), 64, 264),
                               iteration=it + 1)
    state = json.loads(json.dumps(monitor.state_dict()))
    restored = MechanismMonitor(config, trainer.model, trainer.optimizer, iteration=steps)
    restored.load_state_dict(state)
    return state, json.loads(json.dumps(restored.state_dict())), monitor.bytes_held()


def test_monitor_state_survives_a_json_round_trip():
    state, again, held = run_distributed(state_round_trip, 1, 6)[0]
    assert state == again
    assert len(state["spectral_detectors"]["detectors"]) > 0 and len(state["router_detectors"]["detectors"]) > 0
    assert state["prev_load"] is not None and held > 0
