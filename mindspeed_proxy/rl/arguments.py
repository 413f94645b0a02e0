"""Flags of the SFT and GRPO commands: the trainer's Megatron-LM flags plus train_rl.py's RL names."""
from __future__ import annotations

import argparse
import os

from mindspeed_proxy.rl.replay import MODES
from mindspeed_proxy.rl.tasks import TASKS, build_task
from mindspeed_proxy.rl.update import GRPOConfig
from mindspeed_proxy.training import arguments as A

ArgumentError = A.ArgumentError


def build_parser(prog: str, rl: bool = True) -> argparse.ArgumentParser:
    """The trainer's parser with the task flags, and with `rl` the GRPO / rollout / replay flags."""
    p = A.build_parser(prog)
    p.description = "GRPO on a megatron-core MoE policy" if rl else "SFT warm-up of a policy on an RL task"
    p.set_defaults(train_iters=200 if rl else 300, global_batch_size=None, micro_batch_size=16,
                   lr=1e-4 if rl else 3e-3, min_lr=1e-4 if rl else 3e-4, lr_warmup_iters=0 if rl else 10,
                   lr_decay_style="constant" if rl else "cosine", weight_decay=0.0 if rl else 0.01)
    g = p.add_argument_group("task")
    g.add_argument("--rl-task", default="reverse", help=f"embedded task with a verifiable reward: {', '.join(TASKS)}")
    g.add_argument("--rl-partial-credit", type=float, default=0.0,
                   help="reward of a wrong answer: this × the share of positions right (0 = exact match only)")
    if not rl:
        return p
    g = p.add_argument_group("GRPO (Megatron-LM train_rl.py names)")
    g.add_argument("--grpo-group-size", type=int, default=8)
    g.add_argument("--grpo-prompts-per-step", type=int, default=8)
    g.add_argument("--grpo-iterations", type=int, default=1, help="passes over each step's rollouts")
    g.add_argument("--grpo-clamp-eps-lower", type=float, default=0.2)
    g.add_argument("--grpo-clamp-eps-upper", type=float, default=0.2)
    g.add_argument("--grpo-kl-beta", type=float, default=0.0)
    g.add_argument("--grpo-entropy-term-weight", type=float, default=0.0)
    g.add_argument("--rl-default-temperature", type=float, default=1.0)
    g.add_argument("--rl-default-top-p", type=float, default=1.0)
    g.add_argument("--rl-max-new-tokens", type=int, default=None, help="default: the task's response length")
    g.add_argument("--rl-importance-sampling-truncation-coef", type=float, default=None,
                   help="token TIS: weight exp(old - rollout) truncated at this value")
    g.add_argument("--rl-icepop-low", type=float, default=None, help="IcePop: drop tokens whose train/rollout "
                   "ratio is below this (with --rl-icepop-high)")
    g.add_argument("--rl-icepop-high", type=float, default=None)
    g.add_argument("--rl-ratio-type", choices=["token", "sequence"], default="token",
                   help="sequence: the GSPO sequence-level ratio")
    g.add_argument("--rl-eval-prompts", type=int, default=64,
                   help="held-out prompts (x4 samples) scored before the first and after the last step; 0 = none")
    g.add_argument("--rl-save-expert-usage", default=None, metavar="FILE",
                   help="write the tokens routed to each expert over the run (training passes, all ranks) as "
                        "convert_to_proxy.py's --usage-file JSON")
    g.add_argument("--rl-routing-replay", choices=list(MODES), default="off",
                   help="r2: replay the training pass's own first pass; r3: replay the rollout's routing")
    return p


def parse(argv, prog: str, rl: bool = True) -> argparse.Namespace:
    """Parse and check everything that needs no process group; ArgumentError names the flag."""
    args = build_parser(prog, rl).parse_args(argv)
    if args.rl_task not in TASKS:
        raise ArgumentError(f"--rl-task {args.rl_task!r}: unknown task; known: {', '.join(TASKS)}")
    task = build_task(args.rl_task, args.rl_partial_credit)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = world // max(args.tensor_model_parallel_size * args.pipeline_model_parallel_size, 1)
    if args.tensor_model_parallel_size != 1 or args.pipeline_model_parallel_size != 1:
        raise ArgumentError("the RL loop runs TP=1, PP=1 (EP, DP and the distributed optimizer are supported); "
                            f"got --tensor-model-parallel-size {args.tensor_model_parallel_size} "
                            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}")
    if rl:
        new = args.rl_max_new_tokens or task.max_response_length
        args.rl_max_new_tokens = new
        need = task.prompt_length + new
        if args.grpo_group_size < 2:
            raise ArgumentError(f"--grpo-group-size {args.grpo_group_size}: a group needs at least 2 rollouts")
        if args.grpo_prompts_per_step < 1 or args.grpo_prompts_per_step % dp:
            raise ArgumentError(f"--grpo-prompts-per-step {args.grpo_prompts_per_step} is not divisible by the "
                                f"data-parallel size {dp} (world {world})")
        samples = args.grpo_prompts_per_step * args.grpo_group_size
        if args.global_batch_size is None:
            args.global_batch_size = samples
        if samples * args.grpo_iterations % args.global_batch_size:
            raise ArgumentError(f"--grpo-group-size x --grpo-prompts-per-step x --grpo-iterations = "
                                f"{samples * args.grpo_iterations} is not divisible by --global-batch-size "
                                f"{args.global_batch_size}")
        if args.global_batch_size > samples:
            raise ArgumentError(f"--global-batch-size {args.global_batch_size} exceeds one step's rollouts {samples}")
        if (args.rl_icepop_low is None) != (args.rl_icepop_high is None):
            raise ArgumentError("--rl-icepop-low and --rl-icepop-high go together")
        if not 0 < args.rl_default_top_p <= 1 or args.rl_default_temperature < 0:
            raise ArgumentError("--rl-default-top-p must be in (0, 1] and --rl-default-temperature >= 0")
    else:
        need = task.prompt_length + task.max_response_length
        if args.global_batch_size is None:
            args.global_batch_size = 32
    args.micro_batch_size = min(args.micro_batch_size, args.global_batch_size // max(dp, 1) or 1)
    args.seq_length = need  # the sampler's fixed buffer: every pass (SFT included) runs exactly this shape
    A.validate_static(args)
    return args


def grpo_config(args: argparse.Namespace) -> GRPOConfig:
    """The GRPOConfig described by `args`."""
    icepop = None if args.rl_icepop_low is None else (args.rl_icepop_low, args.rl_icepop_high)
    return GRPOConfig(
        group_size=args.grpo_group_size, prompts_per_step=args.grpo_prompts_per_step, iterations=args.grpo_iterations,
        clamp_eps_lower=args.grpo_clamp_eps_lower, clamp_eps_upper=args.grpo_clamp_eps_upper,
        kl_beta=args.grpo_kl_beta, entropy_weight=args.grpo_entropy_term_weight,
        tis_truncation=args.rl_importance_sampling_truncation_coef, icepop=icepop, ratio_type=args.rl_ratio_type,
        routing_replay=args.rl_routing_replay, temperature=args.rl_default_temperature)
