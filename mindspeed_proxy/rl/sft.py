"""SFT warm-up on an RL task's exact answers: `torchrun --nproc-per-node N -m mindspeed_proxy.rl.sft [flags]`.

Trains with the trainer's Megatron step (loss on the answer tokens and EOD only), then samples
held-out prompts at the RL temperature and reports the reward GRPO will start from, and saves
`--save` in the trainer's checkpoint formats (which `convert_to_proxy.py` reads).
"""
from __future__ import annotations

import sys
import time

import torch

PROG = "mindspeed_proxy.rl.sft"


def main(argv=None, prog: str = PROG) -> int:
    """Run the SFT warm-up; returns 0, exits 2 on bad input before anything starts."""
    from mindspeed_proxy.rl.train import quiet_optional_kernels

    quiet_optional_kernels()
    from mindspeed_proxy.rl.train import setup

    args, task, trainer, _ = setup(argv, prog, rl=False)  # first: bad flags exit before megatron-core is imported
    from mindspeed_proxy.rl.rollout import data_parallel_slice, evaluate
    from mindspeed_proxy.rl.sampler import Sampler, SamplingParams
    from mindspeed_proxy.rl.tasks import sft_batch, step_prompts
    from mindspeed_proxy.patches.runtime import phase
    from mindspeed_proxy.training import checkpointing as C
    from mindspeed_proxy.patches.runtime import RUNTIME
    from mindspeed_proxy.training import writers as W
    from mindspeed_proxy.training.loop import MetricsWriter, finish_distributed, resolve_log_dir, stop_nonfinite

    rank0 = torch.distributed.get_rank() == 0
    metrics = MetricsWriter(resolve_log_dir(args), args, enabled=rank0)
    mbs = args.micro_batch_size
    for it in range(args.train_iters):
        prompts = step_prompts(task, args.seed, it, args.global_batch_size, "sft")[
            data_parallel_slice(args.global_batch_size)]
        batches = [sft_batch(task, prompts[i:i + mbs], args.seq_length) for i in range(0, len(prompts), mbs)]
        t0 = time.perf_counter()
        result = trainer.train_step(batches, it + 1)
        step_time = time.perf_counter() - t0
        metrics.write({"type": "step", "iteration": it + 1, "loss": result["loss"], "grad_norm": result["grad_norm"],
                       "lr": result["lr"], "skipped": result["skipped"], "step_time_s": step_time})
        W.log_scalars(RUNTIME.tensorboard_writer, it + 1, result, W.STEP_SCALARS, "sft")
        if result["nonfinite"] and args.check_for_nan_in_loss_and_grad:
            metrics.close()
            stop_nonfinite(prog, it + 1, args)
        if rank0 and (it + 1) % args.log_interval == 0:
            print(f" iteration {it + 1:6d}/{args.train_iters} | sft loss {result['loss']:.4f} | "
                  f"grad norm {result['grad_norm'] or 0:.3f} | {step_time * 1000:.0f} ms", flush=True)
    sampler = Sampler(trainer.model[0], SamplingParams(max_new_tokens=task.max_response_length))
    with phase("recompute"):
        evaluation = evaluate(sampler, task, args.seed, num_prompts=64, samples=4)
    metrics.write({"type": "eval", "iteration": args.train_iters, **evaluation})
    if rank0:
        print(f" eval: reward {evaluation['eval_reward']:.3f}, exact match {evaluation['eval_exact_match']:.3f} "
              f"over {evaluation['eval_rollouts']} sampled rollouts (temperature 1)", flush=True)
    if args.save:
        saver = C.saver(args.ckpt_format)
        saver(args.save, args.train_iters, trainer, args)
        if rank0:
            print(f" saved {args.ckpt_format} checkpoint at iteration {args.train_iters} to {args.save}")
    metrics.close()
    W.close(RUNTIME.tensorboard_writer)
    finish_distributed()
    return 0


if __name__ == "__main__":  # dist_checkpointing spawns helper processes: keep work under main
    sys.exit(main(sys.argv[1:]))
