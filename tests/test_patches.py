"""The monitor patches on real megatron-core: transparent when off, observation-only when on, all entry paths."""
import json
import os

import pytest
import torch

from mindspeed_proxy.testing import run_distributed
from mindspeed_proxy.testing.batches import synthetic_microbatches
from mindspeed_proxy.layout_init import global_init
from mindspeed_proxy.testing.parallel import init_parallel
from mindspeed_proxy.tiny_moe import TinyMoEConfig
from mindspeed_proxy.training.engine import TrainConfig, Trainer, microbatch_sample_ids

STEPS = 15  # samples at 5, 10, 15 (δ = 2) and the expert-feature windows of steps 3, 8, 13: every family


def train_with(mode, tp=1, ep=1, out_dir=None):
    """STEPS steps in a fresh process: 'unpatched', 'patched-off' (patches, monitor off) or 'monitor-on'."""
    from mindspeed_proxy import patches
    from mindspeed_proxy.monitor import MonitorConfig

    if mode != "unpatched":
        config = MonitorConfig(interval=5, delta=2, router_interval=5, output_dir=out_dir or "unused",
                               sinks=["jsonl"] if out_dir else [], expert_features=out_dir is not None,
                               expert_features_start=3, expert_features_interval=5, expert_features_steps=3)
        patches.apply(config, enable_monitor=mode == "monitor-on")
    init_parallel(tp=tp, ep=ep)
    model_cfg = TinyMoEConfig(num_layers=2, sequence_parallel=tp > 1)
    train_cfg = TrainConfig(micro_batch_size=2, global_batch_size=4)
    trainer = Trainer(model_cfg, train_cfg, init_fn=lambda m: global_init(m, seed=5))
    out = []
    for it in range(STEPS):
        batches = synthetic_microbatches(microbatch_sample_ids(train_cfg, it), 64, model_cfg.vocab_size)
        result = trainer.train_step(batches)
        out.append((result["loss"], result["grad_norm"]))
    monitor = patches.active_monitor()
    sampled = None if monitor is None else sorted(monitor.last)
    if monitor is not None:
        monitor.close()
    return {"steps": out, "sampled": sampled}


@pytest.mark.parametrize("layout", [dict(), dict(ep=2), dict(tp=2)], ids=["1rank", "ep2", "tp2-sp"])
def test_patches_are_bit_transparent(layout, tmp_path):
    ranks = 2 if layout else 1
    unpatched = run_distributed(train_with, ranks, "unpatched", **layout)[0]
    off = run_distributed(train_with, ranks, "patched-off", **layout)[0]
    # monitor on with every family and the expert-feature collector (steps 3, 8, 13)
    on = run_distributed(train_with, ranks, "monitor-on", out_dir=str(tmp_path), **layout)[0]
    assert {"expert_features.npz", "expert_usage.json"} <= set(os.listdir(tmp_path))
    assert off["steps"] == unpatched["steps"]  # bit-identical losses and grad norms
    assert on["steps"] == unpatched["steps"]  # observation only
    assert off["sampled"] is None
    assert on["sampled"] == ["attention-spectral", "router", "update-spectral"]


def router_logits_seen():
    """Logits the patched TopKRouter.routing hands over vs a forward-hook recomputation of gating."""
    from mindspeed_proxy import patches
    from mindspeed_proxy.patches.runtime import RUNTIME

    patches.apply({"sinks": [], "router_interval": 1})
    init_parallel()
    trainer = Trainer(TinyMoEConfig(num_layers=2), TrainConfig(micro_batch_size=2, global_batch_size=2))
    seen, reference = [], []
    monitor = RUNTIME.monitor
    original = monitor.on_router_logits
    monitor.on_router_logits = lambda layer, logits, rmap: (seen.append((layer, logits.detach().clone(),
                                                                         rmap.clone())), original(layer, logits, rmap))
    from megatron.core.transformer.moe.router import TopKRouter

    for module in trainer.unwrapped()[0].modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(lambda mod, inp, out: reference.append(
                (mod.layer_number, mod.gating(inp[0]).detach(), out[1].clone())))
    trainer.train_step(synthetic_microbatches([[0, 1]], 64, 264))
    assert len(seen) == len(reference) == 2
    return all(a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) for a, b in zip(seen, reference))


def test_router_patch_sees_the_routers_own_logits():
    assert run_distributed(router_logits_seen, 1)[0]


def test_trainer_takes_the_monitor_flags(tmp_path):
    """The trainer's --mechanism-monitor-* flags set the sampling steps (2 forked ranks; the same trainer under
    `torchrun -m mindspeed_proxy.run examples/train_moe.py` with a monitor config file: tests/test_fault_matrix.py
    and tests/test_determinism.py)."""
    from mindspeed_proxy.training.loop import train

    run_distributed(train, 2, ["--expert-model-parallel-size", "2", "--num-layers", "2", "--train-iters", "12",
                               "--lr-warmup-iters", "2", "--log-dir", str(tmp_path), "--enable-mechanism-monitor",
                               "--mechanism-monitor-interval", "4", "--mechanism-monitor-delta", "2"], timeout=300)
    records = [json.loads(line) for line in open(tmp_path / "mechanism_monitor" / "monitor.jsonl")]
    samples = {(r["family"], r["step"]) for r in records if r["type"] == "sample"}
    assert {("update-spectral", 4), ("attention-spectral", 8), ("router", 10)} <= samples


def test_list_prints_the_registry_table(capsys):
    from mindspeed_proxy.patches.__main__ import main  # in this process: listing applies nothing

    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "megatron.core.transformer.moe.router:TopKRouter.routing" in out
    assert "megatron.core.optimizer:get_megatron_optimizer" in out and "applies" in out


def test_a_target_has_one_owning_feature(capsys):
    """apply_feature patches each target once, so a second feature's row on the same target would be skipped
    without a word: registering one is refused, naming both features, and the table is unchanged."""
    from mindspeed_proxy.patches.__main__ import main
    from mindspeed_proxy.patches.registry import Patch, register, table

    assert main(["--list"]) == 0  # registers every row
    capsys.readouterr()
    rows = table()
    owners = {}
    for row in rows:
        owners.setdefault(row.target, set()).add(row.feature)
    assert all(len(features) == 1 for features in owners.values())
    taken = next(r for r in rows if r.feature == "mechanism-monitor")
    with pytest.raises(ValueError, match=f"{taken.target} of feature other-feature .* mechanism-monitor"):
        register(Patch(taken.target, lambda original: original, "other-feature"))
    assert table() == rows


def plain_torch_optimizer_steps(enable):
    """The monitor enabled (or not) in a loop whose optimizer is not Megatron's: two steps."""
    from torch.optim.optimizer import _global_optimizer_post_hooks as global_hooks

    from mindspeed_proxy import patches

    with patches.apply({"sinks": []}, enable_monitor=enable):  # in this process: the handle reverts it all
        hooks = len(global_hooks)
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        return {"hooks_armed": hooks, "hooks_left": len(global_hooks)}


@pytest.mark.parametrize("enable", [True, False], ids=["monitor-on", "monitor-off"])
def test_monitor_that_cannot_attach_says_so_once(enable, capfd):
    out = plain_torch_optimizer_steps(enable)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("mindspeed-proxy:")]
    if not enable:  # nothing armed, nothing said
        assert out == {"hooks_armed": 0, "hooks_left": 0} and lines == []
        return
    assert out == {"hooks_armed": 1, "hooks_left": 0}  # the check removes itself after the first step
    assert len(lines) == 1, lines
    assert "no monitor hook ran by the first optimizer step" in lines[0]
    assert "not built by the patched megatron.core.optimizer.get_megatron_optimizer" in lines[0]


def test_flags_from_a_pre_parse_that_did_not_know_them():
    """MindSpeed's pre-parse keeps flags no feature registered as strings; the monitor feature types them."""
    from argparse import Namespace

    from mindspeed_proxy.monitor.arguments import monitor_config_from_args, monitor_flags_from

    flags = monitor_flags_from(Namespace(enable_mechanism_monitor=True, mechanism_monitor_interval="4",
                                         mechanism_monitor_delta="2", inject_fault="lr-spike:start=3,x=10"))
    config = monitor_config_from_args(flags)
    assert (config.interval, config.delta, flags.inject_fault) == (4, 2, "lr-spike:start=3,x=10")
    with pytest.raises(ValueError, match="--mechanism-monitor-interval 'four': expected int"):
        monitor_flags_from(Namespace(mechanism_monitor_interval="four"))
