"""The train–rollout gap decomposition and the public RL API on real megatron-core (2 gloo ranks, EP=2, DP=2).

One job runs our GRPO loop with `--rl-gap-interval 1` under R3 and the three RL faults, keeping every
step's per-token decomposition. In the `api` run a minimal loop written here (its own forwards through
megatron-core's RouterReplay, not our sampler passes or rl_step) feeds the same step tensors, routed experts
in the inference-engine layout, through `RolloutObserver` to a second monitor.
"""
from __future__ import annotations

import json
import os

import pytest

from mindspeed_proxy.testing import run_distributed

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--moe-ffn-hidden-size", "32",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--seed", "7", "--expert-model-parallel-size", "2"]
BASE = MODEL + ["--grpo-prompts-per-step", "4", "--grpo-group-size", "4", "--micro-batch-size", "8",
                "--rl-eval-prompts", "0", "--lr", "1e-3", "--min-lr", "1e-3", "--grpo-iterations", "1",
                "--grpo-kl-beta", "0", "--grpo-entropy-term-weight", "0.01",  # a gradient with zero advantages
                "--rl-gap-interval", "1", "--rl-gap-samples", "8"]
API_STEPS, NOISE_START = 10, 7
CONFIGS = {
    "r3": ["--rl-routing-replay", "r3", "--train-iters", "2", "--inject-fault", "rollout-router-noise:start=1,std=0.5"],
    "noise": ["--train-iters", "2", "--inject-fault", "rollout-router-noise:start=1,std=0.5",
              "--rl-gap-layer-interval", "1"],
    "lowp": ["--train-iters", "2", "--inject-fault", "sampler-lowp:start=1,format=bf16"],
    "lag": ["--train-iters", str(API_STEPS), "--inject-fault", f"policy-lag:start={NOISE_START},steps=1",
            "--enable-mechanism-monitor"],
    "api": ["--train-iters", str(API_STEPS), "--inject-fault", f"rollout-router-noise:start={NOISE_START},std=0.5",
            "--enable-mechanism-monitor"],
}


def _test_loop(state, engine, batch, step):
    """A framework's step: its own old-logprob forward (routing recorded through megatron-core), then the API."""
    import dataclasses

    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from megatron.core import parallel_state as ps

    from mindspeed_proxy.monitor import MechanismMonitor, MonitorConfig
    from mindspeed_proxy.patches.runtime import RUNTIME
    from mindspeed_proxy.rl.observe import RolloutObserver

    model, tokens, prompt = engine.model, batch.tokens, batch.prompt_length
    if "observer" not in state:  # as docs/rl.md shows it: a default MonitorConfig, the data-parallel group
        assert dataclasses.replace(RUNTIME.monitor.config, output_dir="x") == MonitorConfig(output_dir="x")
        state["observer"] = RolloutObserver(MechanismMonitor(MonitorConfig(output_dir=state["out"]), model),
                                            ps.get_data_parallel_group())
    model.eval()
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logp = torch.log_softmax(model(tokens, positions, None).float()[:, prompt - 1:-1], dim=-1)
    routed = torch.stack([d.view(tokens.shape[1], tokens.shape[0], -1) for d in RouterReplay.get_recorded_data()])
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_indices()
    model.train()
    old = logp.gather(2, tokens[:, prompt:].clamp_max(logp.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    engine_layout = lambda x: x.permute(2, 1, 0, 3)  # [L, S, B, k] -> the engine's [B, S, L, k]  # noqa: E731
    state["observer"].observe(step, batch.logprobs, old, batch.response_mask, engine_layout(batch.routed_experts),
                              train_routed_experts=engine_layout(routed),
                              routed_probs=engine_layout(batch.routed_probs), model=model, input_ids=tokens,
                              entropy=entropy, micro_batch=8)


def _run(root: str) -> None:
    import torch

    from mindspeed_proxy.patches.runtime import RUNTIME
    from mindspeed_proxy.rl import gap as G
    from mindspeed_proxy.rl.train import main

    original_sums, original_loop = G.gap_sums, G.loop_gap
    for name, flags in CONFIGS.items():
        RUNTIME.reset()
        log, kept, state = os.path.join(root, name), [], {"out": os.path.join(root, name, "api_monitor")}

        def keep(gap):
            kept.append({**{k: v.clone() for k, v in gap.terms().items()}, "mask": gap.mask.clone(),
                         "flipped": gap.flipped.clone()})
            return original_sums(gap)

        def loop_gap(engine, batch, args, step, group=None):
            record = original_loop(engine, batch, args, step, group)
            if name == "api":
                _test_loop(state, engine, batch, step)
            return record

        G.gap_sums, G.loop_gap = keep, loop_gap
        try:
            main(BASE + flags + ["--log-dir", log, "--mechanism-monitor-output", os.path.join(log, "monitor")])
        finally:
            G.gap_sums, G.loop_gap = original_sums, original_loop
        torch.save(kept, os.path.join(log, f"terms{torch.distributed.get_rank()}.pt"))
    RUNTIME.reset()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("rlgap"))
    run_distributed(_run, 2, root, timeout=600)
    return root


def _records(path: str, kind: str = "step") -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [r for r in map(json.loads, fh) if r.get("type") == kind]


def _terms(runs, name):
    import torch

    return [t for rank in (0, 1) for t in torch.load(os.path.join(runs, name, f"terms{rank}.pt"))]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_terms_sum_to_the_total_gap_per_token(runs, name):
    import torch

    for t in _terms(runs, name):
        assert t["total"].dtype == torch.float64 and t["mask"].any()
        torch.testing.assert_close(t["flip"] + t["weights"] + t["other"], t["total"], rtol=0, atol=1e-6)


def test_r3_flip_term_is_exactly_zero_and_router_noise_is_left_in_the_weights(runs):
    import torch

    for t in _terms(runs, "r3"):
        assert torch.equal(t["flip"], torch.zeros_like(t["flip"]))
    for rec in _records(os.path.join(runs, "r3", "metrics.jsonl")):
        assert rec["gap_flip_abs_mean"] == 0.0 and rec["gap_abs_mean"] > 0 and rec["gap_flip_share"] == 0.0
        # R3 replays the noisy rollout's experts, not its probabilities: what is left is the routing weights
        assert rec["gap_cause"] == "routing-mismatch: routing weights", rec


def test_router_noise_flip_term_dominates_and_layers_are_attributed(runs):
    for rec in _records(os.path.join(runs, "noise", "metrics.jsonl")):
        assert rec["gap_cause"] == "routing-mismatch: expert flips", rec
        assert rec["gap_flip_share"] > 0.5 and rec["gap_flipped_token_frac"] > 0
        assert len(rec["gap_layer_flip_abs_mean"]) == 2 and max(rec["gap_layer_flip_abs_mean"]) > 0


def test_sampler_lowp_numeric_term_dominates_flips_within_their_token_share(runs):
    for rec in _records(os.path.join(runs, "lowp", "metrics.jsonl")):
        assert rec["gap_cause"] == "numeric mismatch", rec
        assert rec["gap_other_share"] > 0.5
        assert rec["gap_flip_share"] <= rec["gap_flipped_token_frac"], rec


def test_policy_lag_everything_else_dominates_and_its_alerts_say_so(runs):
    steps = _records(os.path.join(runs, "lag", "metrics.jsonl"))
    assert all(r["faults"] == [] and r["gap_abs_mean"] <= 1e-5 for r in steps[:NOISE_START - 1])
    for rec in steps[NOISE_START - 1:]:
        assert rec["faults"] == ["policy-lag"] and rec["gap_cause"] == "numeric mismatch", rec
        assert rec["gap_other_share"] > 0.5
    alerts = [a for a in _records(os.path.join(runs, "lag", "monitor", "monitor.jsonl"), "alert")
              if a["family"] == "rl"]
    # the routing consistency drops (stale weights route differently), but the gap's cause is not the routing
    assert alerts and min(a["step"] for a in alerts) >= NOISE_START
    assert {a["mechanism"] for a in alerts} == {"numeric mismatch"}
    assert "current weights" in alerts[0]["mitigation"]


def test_public_api_from_a_minimal_loop_gives_our_loops_alerts(runs):
    ours = _records(os.path.join(runs, "api", "monitor", "monitor.jsonl"), "alert")
    theirs = _records(os.path.join(runs, "api", "api_monitor", "monitor.jsonl"), "alert")
    key = lambda a: (a["step"], a["metric"], a["layer"], a["mechanism"], a["mitigation"])  # noqa: E731
    ours_rl = sorted(key(a) for a in ours if a["family"] == "rl")
    assert ours_rl and ours_rl == sorted(key(a) for a in theirs)
    assert min(a[0] for a in ours_rl) >= NOISE_START
    assert {a[3] for a in ours_rl} == {"routing-mismatch: expert flips"}
    samples = {s["step"]: s["layers"] for s in _records(os.path.join(runs, "api", "api_monitor", "monitor.jsonl"),
                                                        "sample")}
    loop = {r["iteration"]: r for r in _records(os.path.join(runs, "api", "metrics.jsonl"))}
    for step, layers in samples.items():  # the same values, reduced over both data-parallel ranks
        assert layers["all"]["gap_abs_mean"] == pytest.approx(loop[step]["gap_abs_mean"], abs=1e-12)
        assert layers["all"]["mismatch_k3_kl"] == pytest.approx(loop[step]["mismatch_k3_kl"], rel=1e-9, abs=1e-12)
        assert [layers[str(i)]["topk_match"] for i in range(2)] == pytest.approx(loop[step]["topk_match"])


@pytest.mark.parametrize("flags, message", [
    (["--rl-gap-layer-interval", "3", "--rl-gap-interval", "2"], "--rl-gap-layer-interval 3: must be a multiple"),
    (["--rl-gap-layer-interval", "1"], "must be a multiple of --rl-gap-interval 0"),
    (["--rl-gap-samples", "0"], "--rl-gap-samples 0: must be >= 1"),
    (["--rl-gap-interval", "-1"], "--rl-gap-interval -1: must be >= 0"),
])
def test_bad_gap_flags_are_refused_at_parse_time(flags, message):
    from mindspeed_proxy.rl.arguments import ArgumentError, parse

    with pytest.raises(ArgumentError, match=message):
        parse(flags, "mindspeed_proxy.rl.train")


def test_engine_layout_is_transposed_to_the_routers_order():
    import torch

    from mindspeed_proxy.rl.observe import engine_to_megatron

    routed = torch.arange(2 * 5 * 3 * 2).view(2, 5, 3, 2)  # [B, S, L, k]
    ours = engine_to_megatron(routed)
    assert ours.shape == (3, 5, 2, 2) and torch.equal(ours[1, 4, 0], routed[0, 4, 1])
    with pytest.raises(ValueError, match=r"expected \[B, S, layers, top-k\]"):
        engine_to_megatron(routed[0])
