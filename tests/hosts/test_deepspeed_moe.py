"""The mechanism monitor on DeepSpeed-MoE layers (`deepspeed.moe.layer.MoE`, ep_size 2) under ZeRO-2 on 2 gloo
ranks: router entropy summed over the data-parallel group, expert load per EP rank, and the ΔW of the experts each
rank holds summed over the expert-parallel group equal the values of the same model (transformers' own Qwen3-MoE
block, the same weights) trained in 1 process without DeepSpeed; monitoring leaves the losses bit-identical; a
reduction over the wrong group (the expert-data-parallel group) fails the comparison; layouts the monitor does
not read are one-line errors.

Tolerances (fp32; DeepSpeed's top-2 gate and dispatch sum in another order than transformers' block, so the
trajectories differ by rounding): 1e-5 relative for every monitor value and the mean loss (measured max: loss
1.1e-7, router 2.3e-7, update-spectral 1.4e-6, attention-spectral 3.3e-7; printed with -s).
"""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e '.[deepspeed]')")

from mindspeed_proxy.testing import run_distributed  # noqa: E402
from test_deepspeed_monitor import (  # noqa: E402  (tests/hosts is on sys.path)
    LR, MICRO, STEPS, _close, init_gloo, single_process, tiny_model, train_steps)

EP = 2
MONITOR = {"interval": 2, "delta": 2, "router_interval": 2, "qk_terms": ["delta1"], "experts_per_layer": 8,
           "sinks": [], "families": ["attention-spectral", "update-spectral", "router"]}
RTOL = 1e-5
WRONG = ("experts over the expert-data-parallel group", "router tokens over the expert-data-parallel group")


class SwiGLU(torch.nn.Module):
    """One expert: down(silu(gate(x)) · up(x)), the function of transformers' fused Qwen3-MoE experts."""

    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, ffn, bias=False)
        self.up_proj = torch.nn.Linear(hidden, ffn, bias=False)
        self.down_proj = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepSpeedMoEBlock(torch.nn.Module):
    """A decoder layer's `mlp`: a DeepSpeed-MoE layer (top-2, no token drop, no 2nd-expert sampling)."""

    def __init__(self, hidden, ffn, experts, ep_size, expert=None):
        super().__init__()
        from deepspeed.moe.layer import MoE

        expert = expert if expert is not None else SwiGLU(hidden, ffn)
        self.moe = MoE(hidden, expert, num_experts=experts, ep_size=ep_size, k=2, drop_tokens=False,
                       use_rts=False, top2_2nd_expert_sampling=False, min_capacity=0)

    def forward(self, hidden_states):
        return self.moe(hidden_states)[0]  # the aux loss is left out on both sides


def reference_model():
    """tiny_model() with normalised top-k weights: the combine of DeepSpeed's top-2 gate."""
    model = tiny_model()
    model.config.norm_topk_prob = True
    for layer in model.model.layers:
        layer.mlp.gate.norm_topk_prob = True
    return model


def deepspeed_moe_model(ep_rank):
    """reference_model() with each MoE block replaced by DeepSpeed-MoE holding this EP rank's experts."""
    model = reference_model()
    cfg = model.config
    local = cfg.num_experts // EP
    with torch.no_grad():
        for layer in model.model.layers:
            native = layer.mlp
            block = DeepSpeedMoEBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, EP)
            block.moe.deepspeed_moe.gate.wg.weight.copy_(native.gate.weight)
            for i, expert in enumerate(block.moe.deepspeed_moe.experts.deepspeed_experts):
                e = ep_rank * local + i
                gate, up = native.experts.gate_up_proj[e].chunk(2, dim=0)
                expert.gate_proj.weight.copy_(gate)
                expert.up_proj.weight.copy_(up)
                expert.down_proj.weight.copy_(native.experts.down_proj[e])
            layer.mlp = block
    return model.train()


def _train(monitored, wrong=None):
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups

    from mindspeed_proxy.hosts.deepspeed import attach_monitor

    rank = dist.get_rank()
    model = deepspeed_moe_model(rank)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "mechanism_monitor": dict(MONITOR)}
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "all"})
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=params)
    monitor = attach_monitor(engine, config) if monitored else None
    if wrong is not None:  # a reduction over the wrong group: DeepSpeed's expert-data-parallel group (size 1)
        edp = groups._get_expert_data_parallel_group(f"ep_size_{EP}")
        if wrong == WRONG[0]:
            monitor.targets.ep_group = edp
        else:
            import dataclasses

            monitor.groups = dataclasses.replace(monitor.groups, dp=edp)
    out = {"losses": train_steps(engine, monitor, rank)}
    if monitor is not None:
        out.update(last=monitor.last, disabled=sorted(monitor.disabled), ep=monitor.groups.ep_size,
                   slots=sorted(s.name for layer in monitor.targets.layers for s in layer.slots
                                if s.expert_parallel))
        monitor.close()
    engine.destroy()
    return out


def runs():
    """The monitored run, the unmonitored run and the two wrong reductions, on each rank."""
    init_gloo()
    return {"monitored": _train(True), "plain": _train(False)["losses"],
            **{w: _train(True, w) for w in WRONG}}


@pytest.fixture(scope="module")
def distributed():
    return run_distributed(runs, 2, timeout=600)


@pytest.fixture(scope="module")
def reference():
    return single_process(reference_model(), MONITOR)  # the same steps, batches and SGD as here


EP_ONLY = ("ep_load", "overload")  # the reference has no EP ranks: checked in test_expert_load_per_ep_rank


def _router_records(layers):
    return {i: {k: v for k, v in rec.items() if k not in EP_ONLY} for i, rec in layers.items()}


def max_rel(a, b) -> float:
    """The largest |a − b| / max(|b|, 1e-3) over two nested records of the same shape."""
    if isinstance(a, dict):
        return max([max_rel(a[k], b[k]) for k in a] + [0.0])
    if isinstance(a, (list, tuple)):
        return max([max_rel(x, y) for x, y in zip(a, b)] + [0.0])
    return abs(a - b) / max(abs(b), 1e-3)


def _compare(run, ref, where):
    """Assert the 2-rank run equals the reference; return the measured max relative error per quantity."""
    mean = [(a + b) / 2 for a, b in zip(run[0]["losses"], run[1]["losses"])]
    _close(mean, ref["losses"], RTOL, f"{where} mean loss")
    worst = {"loss": max_rel(mean, ref["losses"])}
    for rank, r in enumerate(run):
        for family in ("router", "update-spectral", "attention-spectral"):
            assert r["last"][family]["step"] == ref["last"][family]["step"] == STEPS, (where, family)
            mine, theirs = r["last"][family]["layers"], ref["last"][family]["layers"]
            if family == "router":
                mine, theirs = _router_records(mine), _router_records(theirs)
            _close(mine, theirs, RTOL, f"{where} rank {rank} {family}")
            worst[family] = max(worst.get(family, 0.0), max_rel(mine, theirs))
    return worst


def test_each_rank_holds_its_experts(distributed):
    for rank, r in enumerate(distributed):
        run = r["monitored"]
        assert run["ep"] == EP and run["disabled"] == []
        experts = {f"expert{e}.{fc}" for e in range(rank * 4, rank * 4 + 4) for fc in ("fc1", "fc2")}
        assert set(run["slots"]) == experts, run["slots"]  # per layer, the same names


def test_deepspeed_moe_matches_single_process(distributed, reference):
    worst = _compare([r["monitored"] for r in distributed], reference, "EP=2 ZeRO-2")
    print(f"measured max relative error: {worst}")
    for r in distributed:  # every rank has all 8 experts' ΔW after the EP sum
        slots = r["monitored"]["last"]["update-spectral"]["layers"][0]
        assert {f"expert{e}.fc2" for e in range(8)} <= set(slots)


def test_expert_load_per_ep_rank(distributed, reference):
    for r in distributed:
        for layer, rec in r["monitored"]["last"]["router"]["layers"].items():
            load = reference["last"]["router"]["layers"][layer]["load"]
            assert rec["ep_load"] == [sum(load[:4]), sum(load[4:])], (layer, rec["ep_load"], load)
            assert rec["overload"] == pytest.approx(max(rec["ep_load"]) / (sum(rec["ep_load"]) / 2), rel=1e-6)
            # top-2 of every token of the global batch (2 × MICRO rows of 16) over router_interval steps
            assert sum(rec["ep_load"]) == MONITOR["router_interval"] * 2 * 2 * MICRO * 16


@pytest.mark.parametrize("wrong", WRONG)
def test_wrong_reduction_fails_the_comparison(distributed, reference, wrong):
    with pytest.raises(AssertionError) as err:
        _compare([r[wrong] for r in distributed], reference, wrong)
    print(f"{wrong}: {str(err.value).splitlines()[0]}")


def test_monitoring_leaves_losses_bit_identical(distributed):
    for rank, r in enumerate(distributed):
        assert r["monitored"]["losses"] == r["plain"], rank


def test_unsupported_deepspeed_moe_layouts_are_one_line_errors():
    """1 process, ep_size 1 (no process group needed): an expert that is not a gated MLP, and mixed EP sizes."""
    from mindspeed_proxy.hosts.hf_monitor import HFMonitor

    model = reference_model()
    layers = model.model.layers
    layers[0].mlp = DeepSpeedMoEBlock(32, 16, 8, 1, expert=torch.nn.Linear(32, 32))
    with pytest.raises(ValueError, match=r"DeepSpeed-MoE expert Linear: expected gate_proj/up_proj/down_proj") as err:
        HFMonitor(MONITOR, model)
    assert "\n" not in str(err.value)
    layers[0].mlp = DeepSpeedMoEBlock(32, 16, 8, 1)
    layers[1].mlp = DeepSpeedMoEBlock(32, 16, 8, 1)
    monitor = HFMonitor(MONITOR, model)  # ep_size 1: whole experts, owned with their layer (not EP-summed)
    for layer in monitor.targets.layers:
        experts = [s for s in layer.slots if s.name.startswith("expert")]
        assert len(experts) == 16 and not any(s.expert_parallel for s in experts)
    assert monitor.groups.ep_size == 1 and monitor.targets.ep_group is None
    monitor.close()
