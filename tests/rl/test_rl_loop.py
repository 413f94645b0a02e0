"""The GRPO loop on real megatron-core (gloo ranks): routing replay, the rl family, layout equivalence, bad input.

One 2-rank job (EP=2, DP=2) runs four short GRPO configurations in turn and one 1-rank job (EP=1)
repeats the equivalence configuration; the tests read their metrics.jsonl / monitor.jsonl.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys

import pytest

from mindspeed_proxy.testing import run_distributed, run_python

STEPS = 12
NOISE_START = 8
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--moe-ffn-hidden-size", "32",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--rl-partial-credit", "0.5", "--seed", "7"]
BASE = MODEL + ["--grpo-prompts-per-step", "4", "--grpo-group-size", "4", "--micro-batch-size", "8",
                "--rl-eval-prompts", "0", "--lr", "1e-3", "--min-lr", "1e-3", "--grpo-iterations", "1",
                "--grpo-clamp-eps-lower", "0.2", "--grpo-clamp-eps-upper", "0.2", "--grpo-kl-beta", "0",
                "--grpo-filter-groups-with-same-reward"]
SFT = MODEL + ["--train-iters", "250", "--global-batch-size", "32", "--log-interval", "1000"]
NOISE = f"rollout-router-noise:start={NOISE_START},std=0.5"
CONFIGS = {
    "r3": ["--rl-routing-replay", "r3", "--train-iters", "3"],
    "noise_off": ["--rl-routing-replay", "off", "--train-iters", str(STEPS), "--enable-mechanism-monitor",
                  "--inject-fault", NOISE],
    "noise_r3": ["--rl-routing-replay", "r3", "--train-iters", str(STEPS), "--enable-mechanism-monitor",
                 "--inject-fault", NOISE, "--mechanism-monitor-interval", "2"],
    # R2 (replay the old-logprob pass's routing) in both layouts
    "layout": ["--train-iters", "3", "--grpo-kl-beta", "0.01", "--grpo-entropy-term-weight", "0.001",
               "--rl-routing-replay", "r2"],
    "lowp": ["--train-iters", "3", "--inject-fault", "sampler-lowp:start=2,format=bf16"],
    "lag": ["--train-iters", "3", "--inject-fault", "policy-lag:start=2,steps=1"],
    # a NaN gradient at step 2: skipped and counted, or (the default check) the run stops naming the step
    "nan_skip": ["--train-iters", "3", "--inject-fault", "grad-overflow:start=2,param=router,value=nan",
                 "--no-check-for-nan-in-loss-and-grad"],
    "nan_stop": ["--train-iters", "3", "--inject-fault", "grad-overflow:start=2,param=router,value=nan"],
}


def _run_configs(root: str, names: list[str], ep: int) -> None:
    import torch

    from mindspeed_proxy.patches.runtime import RUNTIME
    from mindspeed_proxy.rl import sft
    from mindspeed_proxy.rl.train import main

    ckpt = os.path.join(root, "sft")
    if not os.path.isdir(ckpt):
        sft.main(SFT + ["--expert-model-parallel-size", str(ep), "--save", ckpt, "--log-dir", ckpt + "_logs"])
    for name in names:
        RUNTIME.reset()
        log = os.path.join(root, f"{name}_ep{ep}")
        extra = ["--mechanism-monitor-output", os.path.join(log, "monitor")] if "--enable-mechanism-monitor" in \
            CONFIGS[name] else []
        if name == "layout":
            extra += ["--rl-save-expert-usage", os.path.join(log, "usage.json")]
        argv = BASE + CONFIGS[name] + ["--expert-model-parallel-size", str(ep), "--log-dir", log, "--load", ckpt] + extra
        if name != "nan_stop":
            main(argv)
            continue
        err, code = io.StringIO(), None
        with contextlib.redirect_stderr(err):
            try:
                main(argv)
            except SystemExit as exc:
                code = exc.code
        with open(os.path.join(log, f"stop{torch.distributed.get_rank()}.json"), "w", encoding="utf-8") as fh:
            json.dump({"code": code, "stderr": err.getvalue()}, fh)
    RUNTIME.reset()


def _records(path: str, kind: str = "step") -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [r for r in map(json.loads, fh) if r.get("type") == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("rl"))
    run_distributed(_run_configs, 2, root, list(CONFIGS), 2, timeout=600)
    run_distributed(_run_configs, 1, root, ["layout"], 1, timeout=300)
    return root


def test_sft_warm_up_learns_the_task(runs):
    steps = _records(os.path.join(runs, "sft_logs", "metrics.jsonl"))
    (evaluation,) = _records(os.path.join(runs, "sft_logs", "metrics.jsonl"), "eval")
    assert steps[-1]["loss"] < 0.5 * steps[0]["loss"]
    assert evaluation["eval_reward"] > 0.05 and evaluation["eval_rollouts"] == 256


def test_r3_reproduces_sampler_logprobs_and_routing(runs):
    steps = _records(os.path.join(runs, "r3_ep2", "metrics.jsonl"))
    assert len(steps) == 3
    for rec in steps:
        assert rec["mismatch_abs_logp_max"] <= 1e-5
        assert rec["topk_match_mean"] == 1.0 and rec["any_layer_mismatch"] == 0.0
        assert rec["response_length"] > 0 and 0.0 <= rec["reward_mean"] <= 1.0


def test_router_noise_breaks_consistency_and_the_rl_family_alerts(runs):
    steps = _records(os.path.join(runs, "noise_off_ep2", "metrics.jsonl"))
    before = [r for r in steps if r["iteration"] < NOISE_START]
    after = [r for r in steps if r["iteration"] >= NOISE_START]
    assert all(r["topk_match_mean"] == 1.0 for r in before)
    assert all(r["topk_match_mean"] < 1.0 and r["any_layer_mismatch"] > 0 for r in after)
    assert all(r["mismatch_abs_logp_mean"] > 0 for r in after)
    alerts = _records(os.path.join(runs, "noise_off_ep2", "monitor", "monitor.jsonl"), "alert")
    mismatch = [a for a in alerts if a["family"] == "rl" and a["mechanism"].startswith("routing-mismatch")]
    assert mismatch and min(a["step"] for a in mismatch) >= NOISE_START
    assert "R3" in mismatch[0]["mitigation"]


def test_r3_is_the_control_no_routing_mismatch_alert(runs):
    steps = _records(os.path.join(runs, "noise_r3_ep2", "metrics.jsonl"))
    assert len(steps) == STEPS and all(r["topk_match_mean"] == 1.0 for r in steps)
    alerts = _records(os.path.join(runs, "noise_r3_ep2", "monitor", "monitor.jsonl"), "alert")
    assert not [a for a in alerts if a["mechanism"].startswith("routing-mismatch")]
    samples = _records(os.path.join(runs, "noise_r3_ep2", "monitor", "monitor.jsonl"), "sample")
    assert {"rl", "router", "update-spectral"} <= {s["family"] for s in samples}  # the trainer's families too
    # the first ΔW (steps 0-2) starts at the loaded weights, not at the random init the model was built with
    norms = [sum(st["frobenius"] for layer in s["layers"].values() for st in layer.values())
             for s in samples if s["family"] == "update-spectral"]
    assert len(norms) == STEPS // 2 and norms[0] < 3 * sorted(norms)[len(norms) // 2]


def test_ep2_on_two_ranks_equals_ep1_on_one(runs):
    two = _records(os.path.join(runs, "layout_ep2", "metrics.jsonl"))
    one = _records(os.path.join(runs, "layout_ep1", "metrics.jsonl"))
    assert len(one) == len(two) == 3
    assert all(r["nonzero_groups_ratio"] > 0 for r in one)  # the loss is not trivially zero
    for a, b in zip(one, two):
        # the same rollouts (rewards summed in another order over ranks)
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], rel=1e-12)
        assert a["response_length"] == pytest.approx(b["response_length"], rel=1e-12)
        for key in ("loss", "kl_ref", "entropy", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
        assert a["pi_over_pi_old"] == b["pi_over_pi_old"] == 1.0  # one step per batch: the training pass is π_old


def test_expert_usage_file_is_layout_independent_and_counts_every_routed_token(runs):
    one, two = (json.load(open(os.path.join(runs, f"layout_ep{ep}", "usage.json"))) for ep in (1, 2))
    assert one == two and sorted(one) == ["0", "1"]  # both MoE layers, global ids of all 8 experts
    assert all(len(counts) == 8 for counts in one.values())
    sums = {sum(counts) for counts in one.values()}
    assert len(sums) == 1 and sums.pop() % 2 == 0  # top-2: every counted token adds 2, equally in each layer


@pytest.mark.parametrize("flags, message", [
    (["--grpo-group-size", "1"], "--grpo-group-size 1"),
    (["--grpo-prompts-per-step", "3"], "not divisible by the data-parallel size 2"),
    (["--rl-task", "sudoku"], "--rl-task 'sudoku': unknown task"),
    (["--tensor-model-parallel-size", "2"], "TP=1"),
    (["--grpo-kl-beta", "nan"], "--grpo-kl-beta nan: not a finite number"),
])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, flags, message):
    log = tmp_path / "logs"
    argv = ["-m", "mindspeed_proxy.rl.train", *flags, "--log-dir", str(log), "--save", str(tmp_path / "ckpt")]
    if message == "--grpo-group-size 1":  # a new interpreter: one error line also when its imports print warnings
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "WORLD_SIZE": "2", "RANK": "0"})
    else:  # forked from the fork server (torch / megatron-core imported): ~6 CPU-s less
        proc = run_python(argv, env={"WORLD_SIZE": "2", "RANK": "0"}, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mindspeed_proxy.rl.train: error: ") and message in lines[0], \
        proc.stderr
    assert not log.exists() and not (tmp_path / "ckpt").exists()


def test_non_finite_step_is_skipped_and_counted_or_stops_the_run(runs):
    steps = _records(os.path.join(runs, "nan_skip_ep2", "metrics.jsonl"))
    assert [r["skipped_steps"] for r in steps] == [0, 1, 0]
    assert all(math.isfinite(r["entropy"]) and math.isfinite(r["loss"]) for r in steps)
    assert math.isfinite(steps[2]["grad_norm"])
    stopped = _records(os.path.join(runs, "nan_stop_ep2", "metrics.jsonl"))
    assert [r["iteration"] for r in stopped] == [1]
    for rank in (0, 1):
        with open(os.path.join(runs, "nan_stop_ep2", f"stop{rank}.json"), encoding="utf-8") as fh:
            stop = json.load(fh)
        assert stop["code"] == 1
        lines = [line for line in stop["stderr"].splitlines() if "error" in line]  # (warnings aside)
        if rank == 0:
            assert len(lines) == 1 and lines[0].startswith("mindspeed_proxy.rl.train: error: RL step 2 (optimizer "
                                                           "step 2): NaN or inf"), lines
        else:
            assert not lines


@pytest.mark.parametrize("flags, message", [
    (["--lr", "inf"], "--lr inf: not a finite number"),
    (["--grpo-clamp-eps-lower", "-1"], "--grpo-clamp-eps-lower -1.0: must be >= 0"),
    (["--grpo-clamp-eps-lower", "1"], "must be < 1"),
    (["--rl-icepop-low", "2", "--rl-icepop-high", "0.5"], "need 0 <= low <= high"),
    (["--rl-icepop-low", "0.5"], "go together"),
    (["--rl-ratio-type", "sequence", "--rl-loss-aggregation", "token-mean"], "GSPO"),
    (["--rl-importance-sampling-truncation-coef", "2"], "add --rl-inference-logprobs-is-correction"),
    (["--rl-importance-sampling-truncation-coef", "0", "--rl-inference-logprobs-is-correction"], "must be > 0"),
    (["--rl-dual-clip", "0.5"], "--rl-dual-clip 0.5: must be > 1"),
    (["--rl-default-top-p", "0.9", "--rl-default-top-k", "5"], "exclude each other"),
    (["--rl-default-top-p", "1.5"], "must be in [0, 1]"),
    (["--grpo-iterations", "0"], "--grpo-iterations 0: must be >= 1"),
    (["--grpo-group-size", "3", "--grpo-prompts-per-step", "4", "--global-batch-size", "8"], "does not divide"),
    (["--grpo-prompts-per-step", "4", "--grpo-group-size", "4", "--micro-batch-size", "3"], "--micro-batch-size 3"),
])
def test_bad_values_are_refused_at_parse_time(flags, message):
    from mindspeed_proxy.rl.arguments import ArgumentError, parse

    with pytest.raises(ArgumentError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse(flags, "mindspeed_proxy.rl.train")


def test_megatron_lm_defaults():
    from mindspeed_proxy.rl.arguments import grpo_config, parse

    args = parse([], "mindspeed_proxy.rl.train")
    cfg = grpo_config(args)
    assert (cfg.group_size, cfg.prompts_per_step, cfg.iterations) == (2, 32, 2)
    assert (cfg.clamp_eps_lower, cfg.clamp_eps_upper, cfg.kl_beta, cfg.entropy_weight) == (0.01, 0.01, 0.001, 0.0)
    assert not cfg.filter_groups_with_same_reward and not cfg.correction.active
    assert (args.rl_default_temperature, args.rl_default_top_p, args.rl_default_top_k) == (1.0, 0.0, -1)
    assert args.check_for_nan_in_loss_and_grad and cfg.aggregation == "token-mean"
    assert grpo_config(parse(["--rl-ratio-type", "sequence"], "x")).aggregation == "seq-mean-token-mean"


def test_a_megatron_lm_grpo_flag_set_means_the_same_or_is_refused(capsys):
    """The GRPO flags of Megatron-LM core_v0.16.1's examples/rl/model_configs/qwen3_30b_a3b_moe.sh (defaults)."""
    from mindspeed_proxy.rl.arguments import grpo_config, parse

    flags = ["--grpo-group-size", "16", "--grpo-prompts-per-step", "64", "--grpo-iterations", "1",
             "--grpo-clamp-eps-lower", "0.2", "--grpo-clamp-eps-upper", "0.2", "--grpo-kl-beta", "0.0",
             "--global-batch-size", "256", "--micro-batch-size", "1"]
    args = parse(flags, "mindspeed_proxy.rl.train")
    cfg = grpo_config(args)
    assert (cfg.group_size, cfg.prompts_per_step, cfg.iterations) == (16, 64, 1)
    assert (cfg.clamp_eps_lower, cfg.clamp_eps_upper, cfg.kl_beta) == (0.2, 0.2, 0.0)
    assert (args.global_batch_size, args.micro_batch_size) == (256, 1)
    with pytest.raises(SystemExit) as exc:  # its environment config: Megatron-LM's agent stack, not ours
        parse(flags + ["--langrl-env-config", "env.yaml"], "mindspeed_proxy.rl.train")
    assert exc.value.code == 2 and "unrecognized arguments: --langrl-env-config" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["lowp", "lag"])
def test_sampler_precision_and_policy_lag_faults_open_a_train_rollout_gap(runs, name):
    first, *faulted = _records(os.path.join(runs, f"{name}_ep2", "metrics.jsonl"))
    assert first["faults"] == [] and first["mismatch_abs_logp_max"] <= 1e-5
    for rec in faulted:
        assert rec["faults"] == [{"lowp": "sampler-lowp", "lag": "policy-lag"}[name]]
        assert rec["mismatch_abs_logp_mean"] > 1e-4 and rec["ratio_max"] != 1.0
