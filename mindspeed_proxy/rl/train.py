"""GRPO on a megatron-core MoE policy: `torchrun --nproc-per-node N -m mindspeed_proxy.rl.train [flags]`.

Each step: sample `--grpo-group-size` rollouts of each prompt (no grad, fixed shapes, routing
recorded), score them, recompute the old and reference logprobs (with R2/R3 routing replay),
take the GRPO optimizer step(s) through Megatron's schedule, DDP and optimizer, reduce the RL
metrics over data-parallel ranks, write one metrics.jsonl record and hand the rl family to the
mechanism monitor. `--load` reads the weights (the optimizer starts fresh, as with --finetune);
`--load DIR --rl-resume` continues the RL run saved in DIR (rl/resume.py).
"""
from __future__ import annotations

import collections
import contextlib
import os
import sys
import time
import warnings

import torch

from mindspeed_proxy.cli import error, fail
from mindspeed_proxy.patches.runtime import phase
from mindspeed_proxy.rl import replay
from mindspeed_proxy.rl import stats as S

PROG = "mindspeed_proxy.rl.train"
LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}
REWARD_KEYS = ("reward_sum", "reward_sq_sum", "rows", "exact", "length_sum", "nonzero_groups", "groups")



def quiet_optional_kernels() -> None:
    """megatron-core announces each missing optional kernel package at import; on CPU that is expected."""
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")


def setup(argv, prog: str, rl: bool = True):
    """Parse, validate, start megatron-core and build the Trainer (+ load); returns (args, task, trainer, faults)."""
    quiet_optional_kernels()
    from mindspeed_proxy.faults.spec import parse_fault
    from mindspeed_proxy.rl import resume
    from mindspeed_proxy.rl.arguments import launch_world_size, parse
    from mindspeed_proxy.rl.tasks import build_task
    from mindspeed_proxy.training import arguments as A
    from mindspeed_proxy.training import checkpointing as C
    from mindspeed_proxy.training import writers as W
    from mindspeed_proxy.training.loop import init_distributed, resolve_log_dir

    monitor_config = None
    try:
        args = parse(argv, prog, rl, world=launch_world_size())
        faults = [parse_fault(t) for t in args.inject_fault]
        if args.enable_mechanism_monitor:
            from mindspeed_proxy.monitor.arguments import default_output_dir, monitor_config_from_args

            monitor_config = monitor_config_from_args(args, default_output_dir(resolve_log_dir(args)))
        load_format = C.checkpoint_format(args.load) if args.load else None
        resume.check(args)
        W.check_available(args.tensorboard_dir)
        init_distributed(args)
    except ValueError as exc:
        fail(prog, str(exc))
    task = build_task(args.rl_task, args.rl_partial_credit)
    from mindspeed_proxy.patches.runtime import RUNTIME

    if monitor_config is not None or faults:
        from mindspeed_proxy import patches

        RUNTIME.iteration = resume.resume_iteration(args)
        RUNTIME.resume = bool(getattr(args, "rl_resume", False))  # the monitor's folder continues that run
        patches.apply(monitor_config, enable_monitor=monitor_config is not None, faults=args.inject_fault)
    RUNTIME.tensorboard_writer = W.build_writer(args.tensorboard_dir, torch.distributed.get_rank() == (
        monitor_config.log_rank if monitor_config is not None else 0)) or RUNTIME.tensorboard_writer
    from mindspeed_proxy.training.engine import Trainer

    replay.reset_instances()
    model_cfg = A.model_config(args)
    model_cfg = model_cfg.replace(extra={**model_cfg.extra, "moe_enable_routing_replay": True})
    train_cfg = A.train_config(args)
    if rl:
        per_step = args.grpo_prompts_per_step * args.grpo_group_size * args.grpo_iterations // args.global_batch_size
        train_cfg.train_iters = args.train_iters * per_step
    trainer = Trainer(model_cfg, train_cfg)
    if args.load and not getattr(args, "rl_resume", False):  # --rl-resume: main() loads everything (rl/resume.py)
        loader = C.loader(load_format)
        try:
            loader(args.load, trainer, load_optim=False, load_rng=False)
            if RUNTIME.monitor is not None:
                RUNTIME.monitor.weights_loaded()
        except ValueError as exc:
            if torch.distributed.get_rank() == 0:
                error(prog, exc)
            raise SystemExit(2) from None
    return args, task, trainer, faults


class NonFiniteStep(Exception):
    """An optimizer step whose loss or gradient was not finite (it was not applied)."""

    def __init__(self, step: int, opt_step: int):
        super().__init__(f"RL step {step} (optimizer step {opt_step}): NaN or inf in the loss or the gradients; "
                         "the step was not applied and the run stops (--no-check-for-nan-in-loss-and-grad skips "
                         "and counts such steps)")


def active(faults, name: str, step: int):
    """The fault `name` if it acts at `step`, else None."""
    return next((f for f in faults if f.name == name and f.active(step)), None)


def _reward_sums(rollouts, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from mindspeed_proxy.rl.losses import group_advantages

    r = rollouts.rewards
    advantages, nonzero = group_advantages(r, group_size)
    sums = torch.tensor([r.sum(), r.square().sum(), r.numel(), (r == 1.0).sum(),
                         rollouts.batch.response_mask.sum(), nonzero.sum(), nonzero.numel()], dtype=torch.float64)
    return sums, advantages.float(), nonzero


def rl_step(step: int, args, task, trainer, engine, sampler, faults, ref_weights, history, state) -> dict:
    """One GRPO step (rollouts, passes, optimizer steps, reduced metrics); returns its metrics record."""
    from megatron.core import parallel_state as ps

    from mindspeed_proxy.rl.correction import log_token_ratio, rollout_correction
    from mindspeed_proxy.rl.gap import loop_gap
    from mindspeed_proxy.rl.rollout import sample_step
    from mindspeed_proxy.rl.weights import snapshot, swapped

    cfg, dp_group = engine.cfg, ps.get_data_parallel_group()
    t0 = time.perf_counter()
    lag = active(faults, "policy-lag", step)
    if history.maxlen:
        history.append(snapshot(engine.model))
    stale = history[0] if lag is not None and len(history) == history.maxlen else None
    lowp = active(faults, "sampler-lowp", step)
    sampler.params.autocast_dtype = LOW_PRECISION[lowp["format"]] if lowp is not None else None
    with swapped(engine.model, stale) if stale is not None else contextlib.nullcontext():
        rollouts = sample_step(sampler, task, args.seed, step, cfg.prompts_per_step, cfg.group_size,
                               phase=lambda: phase("rollout"))
    t_rollout = time.perf_counter() - t0
    batch = rollouts.batch
    reward_sums, advantages, nonzero = _reward_sums(rollouts, cfg.group_size)
    rollout_routing = batch.routed_experts if cfg.routing_replay == "r3" else None
    with phase("recompute"):
        old_logp, used_routing, entropy = engine.logprob_pass(batch.tokens, batch.prompt_length,
                                                              routing=rollout_routing, record=True)
        replayed = rollout_routing if cfg.routing_replay == "r3" else used_routing if cfg.routing_replay == "r2" \
            else None
        with swapped(engine.model, ref_weights):
            ref_logp, _, _ = engine.logprob_pass(batch.tokens, batch.prompt_length, routing=replayed)
        gap = loop_gap(engine, batch, args, step, dp_group) if args.rl_gap_interval and \
            step % args.rl_gap_interval == 0 else {}
    loss_mask = batch.response_mask
    if cfg.filter_groups_with_same_reward:  # else (Megatron-LM's default) their tokens stay, with advantage 0
        loss_mask = loss_mask * nonzero.repeat_interleave(cfg.group_size).float().unsqueeze(1)
    train_batch = {"tokens": batch.tokens, "old_logp": old_logp, "ref_logp": ref_logp, "rollout_logp": batch.logprobs,
                   "mask": loss_mask, "advantages": advantages, "routing": replayed,
                   "prompt_length": batch.prompt_length}
    rows_local = batch.tokens.shape[0]
    per_opt = args.global_batch_size // ps.get_data_parallel_world_size()
    results = []
    for _ in range(cfg.iterations):
        for start in range(0, rows_local, per_opt):
            state["opt_step"] += 1
            with phase("train"):
                results.append(engine.train_step(train_batch, torch.arange(start, start + per_opt), state["opt_step"]))
            if results[-1]["nonfinite"] and args.check_for_nan_in_loss_and_grad:
                raise NonFiniteStep(step, state["opt_step"])
    # ---- reductions: one SUM all-reduce of every sum, one MAX all-reduce
    mask = batch.response_mask
    routing_mask = batch.routing_mask().reshape(-1)
    flat_used = used_routing.reshape(used_routing.shape[0], -1, used_routing.shape[-1])
    flat_rollout = batch.routed_experts.reshape(flat_used.shape)
    consistency = S.routing_consistency_sums(flat_rollout, flat_used, routing_mask, num_experts=args.num_experts)
    load = S.expert_load(flat_used, routing_mask, args.num_experts)
    mismatch = S.mismatch_sums(old_logp, batch.logprobs, mask)
    weights, kept = rollout_correction(old_logp, batch.logprobs, loss_mask, cfg.correction)
    if cfg.correction.is_level is None:  # no weight applied: the diagnostic is the train/rollout ratio itself
        weights = torch.exp(log_token_ratio(old_logp, batch.logprobs, loss_mask.bool()))
    importance = S.importance_sums(weights, kept)
    rejection = S.rejection_sums(kept, loss_mask)
    entropy_sums = torch.stack([(entropy.double() * mask).sum(), (S.k3_kl(old_logp, ref_logp).double() * mask).sum()])
    parts = [reward_sums, mismatch, importance[:S.IMPORTANCE_MAX_ENTRY], rejection, entropy_sums, consistency["exact"],
             consistency["jaccard"], consistency["any_mismatch"].view(1), consistency["tokens"].view(1), load.view(-1)]
    flat = torch.cat([p.double().view(-1) for p in parts])
    torch.distributed.all_reduce(flat, group=dp_group)
    abs_delta = ((old_logp - batch.logprobs).abs() * mask).max().double().view(1)
    peak = torch.cat([importance[S.IMPORTANCE_MAX_ENTRY:], abs_delta])
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=dp_group)
    sizes = [p.numel() for p in parts]
    (reward_sums, mismatch, imp, rejection, ent, exact, jac, anym, toks, load) = torch.split(flat, sizes)
    load = load.view(-1, args.num_experts)
    state.setdefault("first_load", load.clone())
    state["usage"] = state["usage"] + load if "usage" in state else load.clone()
    r = dict(zip(REWARD_KEYS, reward_sums.tolist()))
    n_rows, n_tokens = r["rows"], max(float(mismatch[3]), 1.0)
    mean = r["reward_sum"] / n_rows
    routing = S.finalize_routing({"exact": exact, "jaccard": jac, "any_mismatch": anym[0], "tokens": toks[0]})
    drift = S.load_drift(load, state["first_load"]).tolist()
    last = results[-1]
    record = {
        "type": "step", "iteration": step, "reward_mean": mean,
        "reward_std": max(r["reward_sq_sum"] / n_rows - mean * mean, 0.0) ** 0.5,
        "exact_match": r["exact"] / n_rows, "nonzero_groups_ratio": r["nonzero_groups"] / r["groups"],
        "zero_std_groups": int(r["groups"] - r["nonzero_groups"]), "response_length": r["length_sum"] / n_rows,
        "entropy": float(ent[0]) / n_tokens, "kl_ref": float(ent[1]) / n_tokens,
        **{k: last[k] for k in ("loss", "grad_norm", "lr", "skipped", "clip_frac_low", "clip_frac_high",
                                "clip_frac_dual", "pi_over_pi_old", "is_weight_mean", "loss_tokens")},
        **S.finalize_importance(torch.cat([imp, peak[:1]])), **S.finalize_mismatch(mismatch),
        **S.finalize_rejection(rejection),
        "mismatch_abs_logp_max": float(peak[1]),
        "topk_match_mean": routing["topk_match_mean"], "jaccard_mean": routing["jaccard_mean"],
        "any_layer_mismatch": routing["any_layer_mismatch"], "topk_match": routing["topk_match"],
        "load_drift": drift, "load_drift_mean": sum(drift) / len(drift) if drift else 0.0,
        "optimizer_steps": len(results), "skipped_steps": sum(int(x["skipped"]) for x in results),
        "rollout_time_s": t_rollout, "step_time_s": time.perf_counter() - t0, **gap,
    }
    return record


def _evaluate(args, task, sampler, metrics, step: int):
    from mindspeed_proxy.rl.rollout import evaluate

    if not args.rl_eval_prompts:
        return None
    sampler.params.autocast_dtype = None
    with phase("recompute"):
        result = evaluate(sampler, task, args.seed, args.rl_eval_prompts)
    metrics.write({"type": "eval", "iteration": step, **result})
    return result


def write_usage(path: str, model, usage: torch.Tensor) -> None:
    """{"<global layer>": [tokens per expert]} of the MoE layers (rank 0 writes; the counts are all-reduced)."""
    import json

    from megatron.core.transformer.moe.router import TopKRouter

    layers = [m.layer_number - 1 for m in model.modules() if isinstance(m, TopKRouter)]
    if torch.distributed.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({str(layer): [int(c) for c in row] for layer, row in zip(layers, usage.tolist())}, fh)


def main(argv=None, prog: str = PROG) -> int:
    """Run GRPO with Megatron-LM style `argv`; returns 0, exits 2 on bad input before anything starts."""
    quiet_optional_kernels()
    args, task, trainer, faults = setup(argv, prog)  # first: bad flags exit before megatron-core is imported
    from mindspeed_proxy.patches.runtime import RUNTIME
    from mindspeed_proxy.rl.arguments import grpo_config
    from mindspeed_proxy.rl import resume
    from mindspeed_proxy.rl.observe import rl_family
    from mindspeed_proxy.rl.sampler import Sampler, SamplingParams
    from mindspeed_proxy.rl.update import GRPOEngine
    from mindspeed_proxy.rl.weights import snapshot
    from mindspeed_proxy.training import checkpointing as C
    from mindspeed_proxy.training import writers as W
    from mindspeed_proxy.training.loop import MetricsWriter, finish_distributed, resolve_log_dir

    rank0 = torch.distributed.get_rank() == 0
    engine = GRPOEngine(trainer, grpo_config(args))
    sampler = Sampler(engine.model, SamplingParams(args.rl_default_temperature, args.rl_default_top_p,
                                                   args.rl_max_new_tokens, top_k=args.rl_default_top_k))
    lag = next((f["steps"] for f in faults if f.name == "policy-lag"), 0)
    history = collections.deque(maxlen=lag + 1 if lag else 0)
    ref_weights = snapshot(engine.model)
    metrics = MetricsWriter(resolve_log_dir(args), args, enabled=rank0)
    state = {"opt_step": 0}
    monitor, writer = RUNTIME.monitor, RUNTIME.tensorboard_writer
    saver = C.saver(args.ckpt_format)
    parts = resume.parts(monitor, state, ref_weights, history)
    start = resume.load(args, trainer, parts, prog) if args.rl_resume else 0
    if args.rl_resume and monitor is not None:
        monitor.weights_loaded()
    evaluations = [None if args.rl_resume else _evaluate(args, task, sampler, metrics, 0)]
    for step in range(start + 1, args.train_iters + 1):
        try:
            record = rl_step(step, args, task, trainer, engine, sampler, faults, ref_weights, history, state)
        except NonFiniteStep as exc:
            metrics.close()
            if rank0:
                error(prog, exc)
            if monitor is not None:
                monitor.close()
            W.close(writer)
            finish_distributed()
            raise SystemExit(1) from None
        record["faults"] = [f.name for f in faults if f.active(step)]
        metrics.write(record)
        W.log_scalars(writer, step, record, W.RL_SCALARS, "rl")
        if monitor is not None:
            monitor.on_rl_step(step, rl_family(record))
        if rank0 and step % args.log_interval == 0:
            print(f" step {step:5d}/{args.train_iters} | reward {record['reward_mean']:.3f} | "
                  f"exact {record['exact_match']:.3f} | entropy {record['entropy']:.3f} | "
                  f"kl {record['kl_ref']:.2e} | topk-match {record['topk_match_mean']:.4f} | "
                  f"|dlogp| {record['mismatch_abs_logp_mean']:.2e} | grad {record['grad_norm'] or 0:.3f} | "
                  f"{record['step_time_s'] * 1000:.0f} ms", flush=True)
        if args.save and (step == args.train_iters or (args.save_interval and step % args.save_interval == 0)):
            parts[resume.LOOP].step = step
            saver(args.save, step, trainer, args, parts=parts)
    evaluations.append(_evaluate(args, task, sampler, metrics, args.train_iters))
    if args.rl_save_expert_usage and "usage" in state:
        write_usage(args.rl_save_expert_usage, engine.model, state["usage"])
    metrics.close()
    if rank0 and evaluations[0] is not None:
        print(f" eval reward {evaluations[0]['eval_reward']:.3f} -> {evaluations[-1]['eval_reward']:.3f} "
              f"({evaluations[-1]['eval_rollouts']} held-out rollouts each)", flush=True)
    if rank0:
        print(f" metrics written to {metrics.path}", flush=True)
    if monitor is not None:
        if rank0:
            print(f" mechanism monitor: {len(monitor.alerts)} alert(s); records in {monitor.config.output_dir}")
        monitor.close()
    W.close(writer)
    finish_distributed()
    return 0


if __name__ == "__main__":  # dist_checkpointing spawns helper processes: keep work under main
    sys.exit(main(sys.argv[1:]))
