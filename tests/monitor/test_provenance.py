"""Non-finite provenance on real megatron-core training (gloo ranks): the origin of a NaN/inf step is named.

A fault poisons one step (step 2 of 3); the monitor re-runs that step's forward with hooks and scans
the gradients. Finite steps run no re-run and carry no extra hook; training after the poisoned step is
the same with and without the monitor.
"""
import json
import os

import pytest

from mindspeed_proxy.testing import run_distributed

STEPS = 3
ROUTER1 = "decoder.layers.1.mlp.router.weight"
ATTENTION1 = "decoder.layers.1.self_attention"


def poisoned_run(out_dir, faults, ep=1, monitor=True, dropout=0.0):
    """Train STEPS steps with `faults` (and the monitor when `monitor`); per step: skipped, losses, and for every
    forward-step call the phase it ran in and the forward hooks on the model; the monitor's alerts and records."""
    import torch
    from megatron.core.utils import unwrap_model

    from mindspeed_proxy import patches
    from mindspeed_proxy.layout_init import global_init
    from mindspeed_proxy.monitor import MonitorConfig
    from mindspeed_proxy.patches.runtime import RUNTIME
    from mindspeed_proxy.testing.batches import synthetic_microbatches
    from mindspeed_proxy.testing.parallel import init_parallel
    from mindspeed_proxy.tiny_moe import TinyMoEConfig
    from mindspeed_proxy.training.engine import TrainConfig, Trainer, forward_step, microbatch_sample_ids

    config = MonitorConfig(interval=1000, delta=1000, router_interval=1000, output_dir=out_dir, sinks=["jsonl"])
    patches.apply(config, enable_monitor=monitor, faults=faults)
    init_parallel(ep=ep)
    model_cfg = TinyMoEConfig(num_layers=2, extra={"hidden_dropout": dropout, "attention_dropout": dropout})
    train_cfg = TrainConfig(micro_batch_size=2, global_batch_size=4 * ep, lr=1e-3)
    trainer = Trainer(model_cfg, train_cfg, init_fn=lambda m: global_init(m, seed=5))
    calls: list = []

    def counting_forward_step(data_iterator, model):
        hooks = sum(len(m._forward_hooks) for m in unwrap_model(model).modules())
        calls[-1].append((RUNTIME.phase, hooks))
        return forward_step(data_iterator, model)

    steps = []
    for it in range(STEPS):
        calls.append([])
        batches = synthetic_microbatches(microbatch_sample_ids(train_cfg, it), model_cfg.seq_length,
                                         model_cfg.vocab_size)
        result = trainer.train_step(batches, forward_step_func=counting_forward_step)
        steps.append({"skipped": result["skipped"], "loss": result["loss"], "calls": calls[-1]})
    mon = RUNTIME.monitor
    out = {"steps": steps, "modules": sum(1 for _ in unwrap_model(trainer.model[0]).modules()),
           "alerts": [a.mechanism for a in mon.alerts] if mon else [],
           "hook_calls": mon.provenance_hook_calls if mon else None}
    RUNTIME.reset()
    if monitor and torch.distributed.get_rank() == 0:
        with open(os.path.join(out_dir, "monitor.jsonl"), encoding="utf-8") as fh:
            out["records"] = [r for r in map(json.loads, fh) if r["type"] in ("non-finite", "alert")]
    return out


def _finite_steps_are_untouched(run, microbatches=2):
    """Steps 1 and 3: one forward per micro-batch, in the train phase, with no more hooks than step 1 had."""
    baseline = run["steps"][0]["calls"][0][1]
    for index in (0, 2):
        assert run["steps"][index]["calls"] == [("train", baseline)] * microbatches
        assert not run["steps"][index]["skipped"]
    poisoned = run["steps"][1]["calls"]
    assert poisoned[:microbatches] == [("train", baseline)] * microbatches  # the step itself
    assert poisoned[microbatches:] == [("rerun", baseline + run["modules"])] * microbatches  # its re-run
    assert run["steps"][1]["skipped"] and run["hook_calls"] > 0


def _one_record(run):
    records = [r for r in run["records"] if r["type"] == "non-finite"]
    alerts = [r for r in run["records"] if r["type"] == "alert"]
    assert len(records) == 1 and len(alerts) == 1 and records[0]["step"] == 2 and alerts[0]["step"] == 2
    assert alerts[0]["kind"] == "non-finite" and alerts[0]["family"] == "non-finite"
    assert run["alerts"] == [alerts[0]["mechanism"]]
    return records[0], alerts[0]


def test_grad_overflow_on_layer_1_router_is_named_as_that_parameter(tmp_path):
    fault = "grad-overflow:start=2,param=layers.1.mlp.router,value=inf"
    run = run_distributed(poisoned_run, 1, str(tmp_path / "on"), [fault], dropout=0.1)[0]
    plain = run_distributed(poisoned_run, 1, str(tmp_path / "off"), [fault], monitor=False, dropout=0.1)[0]
    record, alert = _one_record(run)
    assert alert["mechanism"] == f"non-finite: origin {ROUTER1} (rank 0)"
    assert record["origin_kind"] == "parameter" and record["module"] is None and record["modules_by_rank"] == {}
    assert record["parameters"] == [{"name": ROUTER1, "ranks": [0]}]
    assert record["nonfinite_parameters_by_rank"] == {"0": 1}
    _finite_steps_are_untouched(run)
    # the re-run (with dropout) leaves training as it was: the RNG continues where the step left it, so the
    # step after the skipped one is bit-identical without the monitor
    assert [s["loss"] for s in run["steps"]] == [s["loss"] for s in plain["steps"]]
    assert plain["alerts"] == [] and plain["hook_calls"] is None


def test_nan_in_layer_1_attention_output_is_named_as_that_module(tmp_path):
    run = run_distributed(poisoned_run, 1, str(tmp_path), [f"nan-activation:start=2,module={ATTENTION1}"])[0]
    record, alert = _one_record(run)
    assert alert["mechanism"] == f"non-finite: origin {ATTENTION1} (rank 0)"
    assert (record["origin_kind"], record["module"], record["module_rank"]) == ("module", ATTENTION1, 0)
    names = [p["name"] for p in record["parameters"]]
    # backward order: the output layer's gradient is computed before layer 1's, layer 1's before layer 0's
    assert names[0] == "output_layer.weight" and record["nonfinite_parameters_by_rank"]["0"] >= len(names) > 1
    layer_of = [int(n.split(".")[2]) for n in names if n.startswith("decoder.layers.")]
    assert layer_of == sorted(layer_of, reverse=True)
    _finite_steps_are_untouched(run)


def test_nan_on_one_rank_at_ep2_names_the_module_and_its_rank(tmp_path):
    fault = f"nan-activation:start=2,module={ATTENTION1},rank=1"
    runs = run_distributed(poisoned_run, 2, str(tmp_path), [fault], ep=2)
    record, alert = _one_record(runs[0])
    assert alert["mechanism"] == f"non-finite: origin {ATTENTION1} (rank 1)"
    assert (record["module"], record["module_rank"]) == (ATTENTION1, 1)
    assert record["modules_by_rank"]["1"] == ATTENTION1
    # rank 0 saw its first NaN only after the tokens of rank 1 reached its experts
    assert record["modules_by_rank"].get("0", "decoder.layers.1.mlp").startswith("decoder.layers.1.mlp")
    params = record["parameters"]
    layer_of = [int(p["name"].split(".")[2]) for p in params if p["name"].startswith("decoder.layers.")]
    assert params[0]["name"] == "output_layer.weight" and layer_of == sorted(layer_of, reverse=True)
    experts = [(int(p["name"].split(".")[6]), p["ranks"]) for p in params if ".local_experts." in p["name"]]
    assert experts and all(ranks == [index // 4] for index, ranks in experts)  # global expert ids: 4 per rank
    for run in runs:  # both ranks re-ran the step (the finite rank joined the collectives) and agree
        _finite_steps_are_untouched(run)
        assert run["alerts"] == [alert["mechanism"]]


@pytest.mark.parametrize("text, message", [
    ("nan-activation:start=2", "nan-activation needs module=NAME"),
    ("nan-activation:module=decoder,value=one", "value must be inf or nan"),
])
def test_bad_nan_activation_specs_are_named(text, message):
    from mindspeed_proxy.faults.spec import parse_fault

    with pytest.raises(ValueError, match=message):
        parse_fault(text)


RL = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--moe-ffn-hidden-size", "32",
      "--num-attention-heads", "4", "--num-query-groups", "2", "--seed", "7", "--grpo-prompts-per-step", "4",
      "--grpo-group-size", "4", "--micro-batch-size", "8", "--rl-eval-prompts", "0", "--grpo-iterations", "1",
      "--train-iters", "3", "--enable-mechanism-monitor", "--no-check-for-nan-in-loss-and-grad"]


def rl_run(root: str, fault: str, ep: int) -> dict:
    """The GRPO loop (mindspeed_proxy.rl.train) with `fault`; its step records and, on rank 0, the monitor's."""
    import torch

    from mindspeed_proxy.patches.runtime import RUNTIME
    from mindspeed_proxy.rl.train import main

    main(RL + ["--inject-fault", fault, "--expert-model-parallel-size", str(ep), "--log-dir", root,
               "--mechanism-monitor-output", os.path.join(root, "monitor")])
    RUNTIME.reset()
    if torch.distributed.get_rank() != 0:
        return {}
    with open(os.path.join(root, "metrics.jsonl"), encoding="utf-8") as fh:
        steps = [r for r in map(json.loads, fh) if r["type"] == "step"]
    with open(os.path.join(root, "monitor", "monitor.jsonl"), encoding="utf-8") as fh:
        records = [r for r in map(json.loads, fh) if r["type"] in ("non-finite", "alert")]
    return {"steps": steps, "records": records}


def test_rl_loop_names_the_origin_at_ep2(tmp_path):
    out = run_distributed(rl_run, 2, str(tmp_path), f"nan-activation:start=2,module={ATTENTION1},rank=1", 2,
                          timeout=600)[0]
    assert [r["skipped_steps"] for r in out["steps"]] == [0, 1, 0]
    records = [r for r in out["records"] if r["type"] == "non-finite"]
    alerts = [r for r in out["records"] if r["type"] == "alert"]
    assert [(r["step"], r["origin"], r["origin_rank"]) for r in records] == [(2, ATTENTION1, 1)]
    assert [a["mechanism"] for a in alerts] == [f"non-finite: origin {ATTENTION1} (rank 1)"]


def test_nan_activation_on_a_module_the_model_lacks_is_refused(tmp_path):
    from mindspeed_proxy.testing.launcher import DistributedTestError

    with pytest.raises(DistributedTestError, match="the model has no module 'decoder.layers.9.self_attention'"):
        run_distributed(poisoned_run, 1, str(tmp_path),
                        ["nan-activation:start=2,module=decoder.layers.9.self_attention"])


def test_combine_picks_the_earliest_module_then_the_lowest_rank_then_a_parameter_then_the_loss():
    from mindspeed_proxy.monitor.provenance import alert_text, combine

    def rank(r, module=None, position=None, params=()):
        return {"rank": r, "module": module, "position": position, "parameters": list(params),
                "count": len(params), "error": None}

    late, early = rank(0, "decoder.layers.1.mlp", 40), rank(1, "decoder.layers.1.self_attention", 30)
    assert alert_text(combine([late, early], 5)) == "non-finite: origin decoder.layers.1.self_attention (rank 1)"
    tie = combine([rank(1, "a", 7), rank(0, "b", 7)], 5)
    assert (tie["origin"], tie["origin_rank"]) == ("b", 0)
    params = combine([rank(0, params=[("w1", -9, -3), ("w0", -2, -1)]), rank(1, params=[("w2", -12, -4)])], 5)
    assert [p["name"] for p in params["parameters"]] == ["w2", "w1", "w0"]
    assert (params["origin"], params["origin_kind"], params["origin_rank"]) == ("w2", "parameter", 1)
    nothing = combine([rank(0), rank(1)], 5)
    assert alert_text(nothing) == "non-finite: origin loss" and nothing["origin_kind"] == "loss"
