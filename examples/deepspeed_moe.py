"""DeepSpeed host end to end: a tiny Qwen3-MoE under ZeRO-2 on 2 ranks, healthy and with a router fault.

    python examples/deepspeed_moe.py [--quick] [--work-dir runs/deepspeed_moe] [--seed N] [--no-pin]

1. healthy: the monitor (router family) attached to the DeepSpeed engine; no alert expected;
2. router-fault: the same run with the router's learning rate ×10 from step --fault-step; the router family
   alerts after it;
3. the healthy model is saved in the Hugging Face format, `convert_to_proxy.py` makes a proxy of it
   after a third of its steps (8 -> 4 experts); the original and the proxy each train on from there under the
   same DeepSpeed config (half as many steps, fresh optimizer) and `mindspeed-proxy compare` compares the two;
4. a few GRPO steps of the healthy policy wrapped by DeepSpeed, with our loss (`mindspeed_proxy.rl.losses`) on
   the model's logits and the public observer (`mindspeed_proxy.rl.observe.RolloutObserver`) feeding the rl
   family.
Runs go to WORK_DIR/{healthy,router-fault,original,proxy} (metrics.jsonl + mechanism_monitor/monitor.jsonl each).
Every rank (and the converter it launches) computes under the pinned numerics of the demos
(`determinism.PINNED_ENV`: one thread, ATen's AVX2 kernels, MKL's COMPATIBLE branch; docs/determinism.md);
--no-pin leaves the caller's environment as it is. --quick: fewer steps (a smoke run; no alert expected
either way). Exit status 1 if a full run's outcome is not the expected one: no router alert on the healthy
run, a router alert at or after the fault step on the faulted one, and `compare` of the original and the
proxy consistent.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VOCAB, SEQ, MICRO, LR = 64, 32, 4, 3e-3
RUNS = ("healthy", "router-fault", "original", "proxy")
ROUTER_FAULT_LR = 10.0
SEED = [0]  # --seed: the model's initialisation and the data; 0 is the one the thresholds were chosen on


def monitor_block(run_dir: str) -> dict:
    """The "mechanism_monitor" block: the router family every step, short warm-up for a short run."""
    return {"families": ["router", "rl"], "router_interval": 1, "sinks": ["jsonl"],
            "output_dir": os.path.join(run_dir, "mechanism_monitor"),
            # a drop of the routing entropy by > 30% of its warm-up level, 3 samples running (healthy
            # learning lowers it by up to ~20% here; the router fault by ~55%)
            "router_detector": {"warmup": 8, "persistence": 3, "z_threshold": 6.0, "min_rel_scale": 0.05}}


def ds_config(run_dir: str) -> dict:
    """ZeRO-2, AdamW, clipping 1.0, plus the monitor block (DeepSpeed ignores the extra key)."""
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
            "mechanism_monitor": monitor_block(run_dir)}


def tiny_model():
    """A 2-layer Qwen3-MoE (4 query heads on 2 KV heads, q/k norms, 8 experts top-2), initialised from --seed."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=SEQ,
                         attn_implementation="eager", tie_word_embeddings=False)
    torch.manual_seed(SEED[0])
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # transformers starts the gate at zero: give the router something to route with
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.1)
    return model.train()


def batch(step: int, rank: int):
    """Counting sequences x, x+s, x+2s, ... mod VOCAB (start and stride per row): learnable in a few steps."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank + 1_000_003 * SEED[0])
    start = torch.randint(0, VOCAB, (MICRO, 1), generator=g)
    stride = torch.randint(1, 4, (MICRO, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def _param_groups(model):
    router = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("mlp.gate.weight")]
    return [{"params": rest}, {"params": router}]


def train(model, run_dir: str, steps: int, fault_step: int | None = None, save: tuple | None = None,
          data_offset: int = 0):
    """Train `model` under ZeRO-2 with the monitor attached (save = (step, folder): the Hugging Face weights
    after that step); write metrics.jsonl; return (engine, monitor)."""
    import deepspeed
    import torch.distributed as dist

    from mindspeed_proxy.hosts.deepspeed import attach_monitor

    config = ds_config(run_dir)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=_param_groups(model))
    monitor = attach_monitor(engine, config)
    rank = dist.get_rank()
    metrics = open(os.path.join(run_dir, "metrics.jsonl"), "w", encoding="utf-8") if rank == 0 else None
    if metrics:
        from mindspeed_proxy.determinism import numerics_record

        metrics.write(json.dumps({"type": "args", "args": {"steps": steps, "fault_step": fault_step},
                                  "numerics": numerics_record()}) + "\n")
    if fault_step is not None:
        monitor.log_record({"type": "faults", "faults": [{"kind": "router-lr", "scale": ROUTER_FAULT_LR,
                                                          "start": fault_step}]})
    for step in range(1, steps + 1):
        if step == fault_step:  # the router's parameter group (group 1) at ×10 from here on
            engine.optimizer.param_groups[1]["lr"] = LR * ROUTER_FAULT_LR
        ids = batch(data_offset + step, rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        monitor.step()
        if metrics:
            metrics.write(json.dumps({"type": "step", "iteration": step, "loss": loss.item(),
                                      "grad_norm": float(engine.get_global_grad_norm() or 0.0)}) + "\n")
        if save and step == save[0]:
            if rank == 0:  # ZeRO-2: the parameters are whole on every rank
                engine.module.save_pretrained(save[1])
            dist.barrier()
    if metrics:
        metrics.close()
    return engine, monitor


def grpo_steps(engine, monitor, steps: int, group: int = 4, prompt: int = 4, response: int = 8) -> list:
    """A few GRPO steps of the DeepSpeed-wrapped policy; reward: the response continues the prompt's count."""
    import torch
    import torch.distributed as dist

    from mindspeed_proxy.rl.losses import grpo_token_loss, group_advantages, masked_mean
    from mindspeed_proxy.rl.observe import RolloutObserver

    observer = RolloutObserver(monitor, engine.data_parallel_group)
    policy, rank, records = engine.module, dist.get_rank(), []
    for step in range(1, steps + 1):
        prompts = batch(10_000 + step, rank)[:, :prompt].repeat_interleave(group, dim=0)  # [MICRO·G, P]
        g = torch.Generator().manual_seed(7 * step + rank)
        seq, rollout_logp = prompts, []
        policy.eval()
        with torch.no_grad():  # the rollout: sampling at temperature 1 (no KV cache: the model is tiny)
            for _ in range(response):
                logp = torch.log_softmax(policy(input_ids=seq).logits[:, -1].float(), dim=-1)
                nxt = torch.multinomial(logp.exp(), 1, generator=g)
                rollout_logp.append(logp.gather(1, nxt))
                seq = torch.cat([seq, nxt], dim=1)
        policy.train()
        rollout_logp = torch.cat(rollout_logp, dim=1)
        stride = (prompts[:, -1] - prompts[:, -2]) % VOCAB
        expected = (prompts[:, -1:] + stride[:, None] * torch.arange(1, response + 1)) % VOCAB
        rewards = (seq[:, prompt:] == expected).float().mean(dim=1)
        advantages, _ = group_advantages(rewards, group)
        mask = torch.ones_like(rollout_logp)
        logits = engine(input_ids=seq).logits[:, prompt - 1:-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(2, seq[:, prompt:, None]).squeeze(-1)
        old_logp = logp.detach()  # one update per rollout: the ratio is 1, the gradient is −A·∇logp
        token_loss, _ = grpo_token_loss(logp, old_logp, None, advantages, mask, clamp_eps_lower=0.2,
                                        clamp_eps_upper=0.2)
        loss = masked_mean(token_loss, mask)
        engine.backward(loss)
        engine.step()
        monitor.step()
        record = observer.observe(step, rollout_logp, old_logp, mask)
        reward = rewards.mean().clone()
        dist.all_reduce(reward, group=engine.data_parallel_group)
        record["reward_mean"] = float(reward) / dist.get_world_size(engine.data_parallel_group)
        records.append(record)
    return records


def rank_job(work_dir: str, steps: int, fault_step: int, grpo: int, seed: int = 0) -> dict:
    """Every phase on this rank (run by `run_distributed`, 2 ranks); returns what rank 0 reports."""
    SEED[0] = seed
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from mindspeed_proxy.hosts.deepspeed import skip_shm_comm_build

    skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, out = dist.get_rank(), {}
    dirs = {name: os.path.join(work_dir, name) for name in RUNS}
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    hf_dir, proxy_dir = os.path.join(work_dir, "healthy-hf"), os.path.join(work_dir, "proxy-hf")

    seconds, t0 = {}, time.perf_counter()

    def lap(name):
        nonlocal t0
        seconds[name], t0 = round(time.perf_counter() - t0, 1), time.perf_counter()

    engine, monitor = train(tiny_model(), dirs["healthy"], steps, save=(max(steps // 3, 1), hf_dir))
    lap("healthy")
    out["healthy_alerts"] = [a.to_dict() for a in monitor.alerts if a.family == "router"]
    out["grpo"] = grpo_steps(engine, monitor, grpo)
    monitor.close()
    engine.destroy()
    lap("grpo")

    engine, monitor = train(tiny_model(), dirs["router-fault"], steps, fault_step=fault_step)
    out["fault_alerts"] = [a.to_dict() for a in monitor.alerts if a.family == "router"]
    monitor.close()
    engine.destroy()
    lap("router-fault")

    if rank == 0:  # the converter: one process, the saved Hugging Face folder in, a proxy folder out
        cmd = [sys.executable, os.path.join(ROOT, "convert_to_proxy.py"), "--load", hf_dir, "--save", proxy_dir,
               "--target-expert-parallel-size", "2", "--target-num-experts", "4", "--overwrite"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        out["convert"] = {"rc": proc.returncode, "tail": (proc.stdout + proc.stderr)[-2000:]}
    ok = [out.get("convert", {}).get("rc", 0) == 0]
    dist.broadcast_object_list(ok, src=0)
    lap("convert")
    out["seconds"] = seconds
    if not ok[0]:
        return out
    # the original and its proxy go on from the saved weights: same data, same config, fresh optimizer
    for name, folder in (("original", hf_dir), ("proxy", proxy_dir)):
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").train()
        out[f"{name}_experts"] = model.config.num_experts
        engine, monitor = train(model, dirs[name], steps // 2, data_offset=steps // 3)
        monitor.close()
        engine.destroy()
        lap(name)
    return out


def _numerics(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return json.loads(fh.readline())["numerics"]


def _losses(run_dir: str) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return [r["loss"] for r in map(json.loads, fh) if r.get("type") == "step"]


def main(argv=None) -> int:
    """Run the example; print what each phase showed; 0 when the outcome is the expected one."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "deepspeed_moe"))
    p.add_argument("--quick", action="store_true", help="12 steps, 1 GRPO step: a smoke run")
    p.add_argument("--steps", type=int, default=None, help="steps per training run (default 60, quick 12)")
    p.add_argument("--fault-step", type=int, default=None, help="the router LR ×10 from this step (default 30)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data (default 0, on which the "
                   "monitor block's thresholds were chosen; other seeds are held-out runs)")
    p.add_argument("--no-pin", action="store_true", help="do not pin the numerics (determinism.PINNED_ENV): the "
                   "ranks run with the caller's environment (threads stay 1)")
    args = p.parse_args(argv)
    steps = args.steps or (12 if args.quick else 60)
    fault_step = args.fault_step or (6 if args.quick else 30)
    if not 1 <= fault_step <= steps:
        print(f"deepspeed_moe: --fault-step {fault_step} is outside 1..{steps}", file=sys.stderr)
        return 2
    from mindspeed_proxy.extras import MissingExtra, require

    try:
        for module in ("deepspeed", "transformers"):
            require(module, "examples/deepspeed_moe.py", extra="deepspeed")
        require("scipy.stats", "examples/deepspeed_moe.py (its compare)", extra="report")
    except MissingExtra as exc:
        print(f"deepspeed_moe: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in RUNS + ("healthy-hf", "proxy-hf"):  # this example's own outputs
        shutil.rmtree(os.path.join(args.work_dir, name), ignore_errors=True)
    from mindspeed_proxy.determinism import PINNED_ENV
    from mindspeed_proxy.report.compare import compare_runs, format_table
    from mindspeed_proxy.testing import run_distributed

    env = {"OMP_NUM_THREADS": "1"} if args.no_pin else PINNED_ENV
    print("pinned numerics: " + ("none (--no-pin)" if args.no_pin else " ".join(f"{k}={v}" for k, v in env.items())))
    out = run_distributed(rank_job, 2, args.work_dir, steps, fault_step, 1 if args.quick else 4, args.seed,
                          timeout=900, env=env)[0]
    if out.get("convert", {}).get("rc"):
        print(f"deepspeed_moe: convert_to_proxy.py failed:\n{out['convert']['tail']}", file=sys.stderr)
        return 1
    runs = {n: os.path.join(args.work_dir, n) for n in RUNS}
    for name, path in runs.items():
        losses = _losses(path)
        print(f"{name:13s} loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps ({path})")
    print(f"router alerts: healthy {len(out['healthy_alerts'])}, router-fault {len(out['fault_alerts'])}"
          + "".join(f"\n  {a['metric']} layer {a['layer']} at step {a['step']}" for a in out["fault_alerts"][:4]))
    print(f"proxy: {out['proxy_experts']} experts (from {out['original_experts']}); original and proxy go on "
          f"from the healthy run's weights after step {max(steps // 3, 1)}")
    print("seconds per phase (rank 0):", out["seconds"])
    for r in out["grpo"]:
        print(f"GRPO step {r['iteration']}: reward {r['reward_mean']:.3f}, mismatch "
              f"{r.get('mismatch_abs_logp_max', 0.0):.2e}")
    print("\nmindspeed-proxy compare original proxy:")
    result = compare_runs(runs["original"], runs["proxy"])
    print(format_table(result))
    numerics = _numerics(runs["healthy"])
    print(f"\nnumerics: torch {numerics['torch']}, ATen {numerics['cpu_capability']}, {numerics['threads']} "
          f"thread(s) per rank, MKL_CBWR={numerics['env'].get('MKL_CBWR')}, on {numerics['cpu']}")
    if args.quick:
        return 0
    missed = (["a router alert on the healthy run"] if out["healthy_alerts"] else []) + \
        ([] if any(a["step"] >= fault_step for a in out["fault_alerts"]) else
         [f"no router alert at or after the fault step {fault_step}"]) + \
        ([] if result["verdict"] == "consistent" else ["compare: " + "; ".join(result["reasons"])])
    print("\noutcome:", "as expected (no healthy alert, the fault alerted, compare consistent)" if not missed
          else "NOT as expected: " + "; ".join(missed))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
