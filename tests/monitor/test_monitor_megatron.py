"""MechanismMonitor on real megatron-core models: every layout reports what the 1-rank run reports.

Weights from `global_init` and batches by global sample id make the layouts train the same model on the
same data, so each family's statistics must agree with the single-process run (spectral 1e-3 relative:
ΔW of one step is a difference of nearly equal weights; token counts exactly).
"""
import json
import math

import pytest
import torch

from mindspeed_proxy.monitor import MechanismMonitor, MonitorConfig
from mindspeed_proxy.testing import run_distributed
from mindspeed_proxy.testing.batches import synthetic_microbatches
from mindspeed_proxy.layout_init import global_init
from mindspeed_proxy.testing.parallel import init_parallel
from mindspeed_proxy.testing.routing import routed_to
from mindspeed_proxy.tiny_moe import TinyMoEConfig
from mindspeed_proxy.training.engine import TrainConfig, Trainer, microbatch_sample_ids


def monitored_run(tp=1, ep=1, pp=1, steps=4, num_layers=2, layer_freq=1, out_dir=None, fail_on_rank=None,
                  groups=2, use_dist_opt=False, fail_target="qk_increment_spectra", monitor_overrides=None):
    """Train `steps` steps with the monitor on; return its last results, bytes held and disabled set."""
    init_parallel(tp=tp, ep=ep, pp=pp)
    model_cfg = TinyMoEConfig(num_layers=num_layers, sequence_parallel=tp > 1, moe_layer_freq=layer_freq,
                              num_query_groups=groups)
    train_cfg = TrainConfig(micro_batch_size=2, global_batch_size=4, use_distributed_optimizer=use_dist_opt)
    trainer = Trainer(model_cfg, train_cfg, init_fn=lambda m: global_init(m, seed=3))
    config = MonitorConfig(**{**dict(interval=2, delta=1, router_interval=1, experts_per_layer=3,
                                      output_dir=out_dir or "unused", sinks=["jsonl"] if out_dir else []),
                              **(monitor_overrides or {})})
    monitor = MechanismMonitor(config, trainer.model, trainer.optimizer)
    if fail_on_rank is not None:
        import torch.distributed as dist

        from mindspeed_proxy.monitor import spectral_family as monitor_module  # where the spectral steps look them up

        if dist.get_rank() == fail_on_rank:
            def broken(*args, **kwargs):
                raise RuntimeError(f"injected failure in {fail_target}")
            setattr(monitor_module, fail_target, broken)
    trainer.monitor = monitor
    losses = []
    with routed_to(monitor):
        for it in range(steps):
            batches = synthetic_microbatches(microbatch_sample_ids(train_cfg, it), model_cfg.seq_length,
                                             model_cfg.vocab_size)
            losses.append(trainer.train_step(batches, iteration=it + 1)["loss"])
    grams = sum(t.numel() * t.element_size() for cached, _ in monitor._qk_grams.values() for t in _tensors(cached))
    snapshots = sum(s.numel() * s.element_size() for s in monitor.snapshots.values())
    assert monitor.bytes_held() >= snapshots + grams and (grams > 0) == bool(monitor._qk_grams)
    result = {"last": json.loads(json.dumps(monitor.last)), "bytes": monitor.bytes_held(),
              "disabled": sorted(monitor.disabled), "losses": losses,
              "gram_reuses": {layer: reuses for layer, (_, reuses) in monitor._qk_grams.items()}}
    monitor.close()
    return result


def _tensors(obj):
    """The tensors nested in tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else []
    return [t for item in items for t in _tensors(item)]


def flatten(obj, prefix=""):
    """Leaf values of nested dicts, keyed by path."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}/{k}"))
        return out
    if isinstance(obj, list):
        return {f"{prefix}[{i}]": v for i, v in enumerate(obj)}
    return {prefix: obj}


def assert_same_results(run, ref, rtol=1e-3, atol=1e-6):
    """All statistics agree, except `overload`, which is per EP rank and so depends on the EP size."""
    a, b = flatten(run["last"]), flatten(ref["last"])
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:10]
    for key in a:
        if key.endswith("/overload"):
            continue
        assert math.isclose(a[key], b[key], rel_tol=rtol, abs_tol=atol), (key, a[key], b[key])


@pytest.fixture(scope="module")
def reference():
    return run_distributed(monitored_run, 1)[0]


def test_reference_has_all_three_families(reference):
    last = reference["last"]
    assert set(last) == {"router", "update-spectral", "attention-spectral"}
    assert last["update-spectral"]["step"] == 4 and last["router"]["step"] == 4
    layer0 = last["update-spectral"]["layers"]["0"]
    assert {"linear_qkv", "linear_proj", "router"} <= set(layer0)
    assert {"expert0.fc1", "expert2.fc2", "expert5.fc1"} <= set(layer0)  # 3 experts spread over 8
    heads = last["attention-spectral"]["layers"]["1"]["delta2"]["heads"]
    assert sorted(heads) == ["0", "1", "2", "3"]
    router = last["router"]["layers"]["0"]
    assert router["tokens"] == 4 * 64  # one global batch of 4 x 64 tokens
    assert sum(router["load"]) == 2 * router["tokens"]  # top-2
    assert 0 < router["normalized_entropy"] <= 1 and -1 <= router["similarity"] <= 1
    assert reference["bytes"] > 0


@pytest.mark.parametrize("layout", [dict(tp=2), dict(ep=2), dict(ep=1), dict(ep=2, use_dist_opt=True)],
                         ids=["tp2-sp", "ep2", "dp2", "ep2-distopt"])
def test_layout_reports_what_one_rank_reports(layout, reference):
    runs = run_distributed(monitored_run, 2, **layout)
    assert runs[0]["last"] == runs[1]["last"]  # identical on every rank
    assert_same_results(runs[0], reference)
    ep = layout.get("ep", 1)
    for layer in runs[0]["last"]["router"]["layers"].values():
        load = layer["load"]
        per_rank = [sum(load[r * len(load) // ep:(r + 1) * len(load) // ep]) for r in range(ep)]
        assert layer["overload"] == pytest.approx(max(per_rank) / (sum(per_rank) / ep), rel=1e-6)


def test_qk_gram_reuse_reports_what_recomputing_reports():
    """δ = interval: samples 4, 6, 8 reuse the snapshot's q/k Gram kept from the sample before (TP2, GQA)."""
    overrides = dict(interval=2, delta=2, qk_terms=["delta1", "delta2", "delta3"])
    reused = run_distributed(monitored_run, 2, tp=2, steps=8, monitor_overrides=overrides)
    exact = run_distributed(monitored_run, 1, steps=8, monitor_overrides={**overrides, "qk_gram_reuse": 0})[0]
    assert reused[0]["gram_reuses"] == {0: 3, 1: 3} and exact["gram_reuses"] == {0: 0, 1: 0}
    assert reused[0]["last"] == reused[1]["last"]
    attention = [{"last": {"a": run["last"]["attention-spectral"]}} for run in (reused[0], exact)]
    assert attention[0]["last"]["a"]["step"] == 8
    assert_same_results(*attention, rtol=1e-4)


def test_mqa_with_tp_larger_than_query_groups():
    ref = run_distributed(monitored_run, 1, groups=1)[0]
    run = run_distributed(monitored_run, 2, tp=2, groups=1)[0]
    assert_same_results(run, ref)


def test_pp2_with_a_dense_stage_completes_and_covers_every_layer():
    ref = run_distributed(monitored_run, 1, layer_freq=[0, 1])[0]
    runs = run_distributed(monitored_run, 2, pp=2, layer_freq=[0, 1], timeout=300)
    assert runs[0]["last"] == runs[1]["last"]
    assert sorted(runs[0]["last"]["router"]["layers"]) == ["1"]  # only layer 1 is MoE
    assert sorted(runs[0]["last"]["update-spectral"]["layers"]) == ["0", "1"]
    assert_same_results(runs[0], ref)


@pytest.mark.parametrize("target,statistic,rank", [
    ("qk_increment_spectra", "attention-spectral", 0),
    ("singular_values_from_gram", "update-spectral", 1),  # rank 1 owns experts 4-7: fails there only
])
def test_failing_statistic_is_disabled_everywhere_and_reported_once(tmp_path, target, statistic, rank):
    healthy = run_distributed(monitored_run, 2, ep=2, steps=10)[0]
    runs = run_distributed(monitored_run, 2, ep=2, steps=10, out_dir=str(tmp_path), fail_on_rank=rank,
                           fail_target=target)
    for run in runs:
        assert run["disabled"] == [statistic]
        assert run["losses"] == healthy["losses"]  # training itself untouched
    records = [json.loads(line) for line in open(tmp_path / "monitor.jsonl")]
    errors = [r for r in records if r["type"] == "monitor-error"]
    assert len(errors) == 1 and errors[0]["statistic"] == statistic
    families = {r["family"] for r in records if r["type"] == "sample" and r["step"] > 2}
    assert families == {"router", "update-spectral", "attention-spectral"} - {statistic}
