"""Flags of the SFT and GRPO commands: the trainer's Megatron-LM flags plus train_rl.py's RL names."""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from mindspeed_proxy.rl.aggregation import AGGREGATIONS, GSPO_AGGREGATION
from mindspeed_proxy.rl.correction import LEVELS, Correction
from mindspeed_proxy.rl.losses import KL_ESTIMATORS
from mindspeed_proxy.rl.replay import MODES
from mindspeed_proxy.rl.tasks import TASKS, build_task
from mindspeed_proxy.training import arguments as A

if TYPE_CHECKING:
    from mindspeed_proxy.rl.update import GRPOConfig

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
    g = p.add_argument_group("GRPO (Megatron-LM train_rl.py names, defaults and meanings)")
    g.add_argument("--grpo-group-size", type=int, default=2, help="rollouts per prompt (a GRPO group)")
    g.add_argument("--grpo-prompts-per-step", type=int, default=32, help="prompts (groups) per RL step")
    g.add_argument("--grpo-iterations", type=int, default=2, help="passes over each step's rollouts")
    g.add_argument("--grpo-clamp-eps-lower", type=float, default=0.01, help="ratio clipped below at 1 - this")
    g.add_argument("--grpo-clamp-eps-upper", type=float, default=0.01, help="ratio clipped above at 1 + this")
    g.add_argument("--grpo-kl-beta", type=float, default=0.001, help="weight of the KL to the reference policy")
    g.add_argument("--grpo-entropy-term-weight", type=float, default=0.0,
                   help="weight of the entropy bonus (here: entropy of the full next-token distribution)")
    g.add_argument("--grpo-filter-groups-with-same-reward", action="store_true",
                   help="leave groups whose rewards are all equal out of the loss (by default their tokens stay, "
                        "with advantage 0: the KL and entropy terms act on them)")
    g.add_argument("--rl-default-temperature", type=float, default=1.0)
    g.add_argument("--rl-default-top-p", type=float, default=0.0, help="nucleus sampling; 0 = off")
    g.add_argument("--rl-default-top-k", type=int, default=-1, help="top-k sampling; <= 0 = off, 1 = greedy")
    g.add_argument("--rl-max-new-tokens", type=int, default=None, help="default: the task's response length")
    g.add_argument("--rl-inference-logprobs-is-correction", action=argparse.BooleanOptionalAction, default=False,
                   help="weight each token's policy term by the train/rollout ratio exp(old - rollout)")
    g.add_argument("--rl-importance-sampling-truncation-coef", type=float, default=None,
                   help="with --rl-inference-logprobs-is-correction: truncate the IS weight at this value (TIS)")
    g = p.add_argument_group("GRPO objective (verl / slime / NeMo-RL options)")
    g.add_argument("--rl-loss-aggregation", choices=list(AGGREGATIONS), default=None,
                   help="reduction of the per-token loss over the step's global batch (default token-mean; "
                        "GSPO: seq-mean-token-mean); seq-mean-token-sum-norm is Dr.GRPO")
    g.add_argument("--rl-ratio-type", choices=["token", "sequence"], default="token",
                   help="sequence: the GSPO sequence-level ratio and objective")
    g.add_argument("--rl-dual-clip", type=float, default=None, metavar="C",
                   help="dual-clip: a token with negative advantage and ratio > C contributes -C*A (verl: 3)")
    g.add_argument("--grpo-kl-estimator", choices=list(KL_ESTIMATORS), default="k3",
                   help="KL(pi || pi_ref) estimator per token")
    g.add_argument("--rl-is-level", choices=list(LEVELS), default=None,
                   help="with --rl-inference-logprobs-is-correction: token (default) weight, or one weight per "
                        "sequence: the product (sequence) or the geometric mean (geometric) of the token ratios")
    g.add_argument("--rl-rejection-level", choices=list(LEVELS), default=None,
                   help="drop tokens / sequences whose train/rollout ratio at this level lies outside "
                        "[--rl-rejection-low, --rl-rejection-high]")
    g.add_argument("--rl-rejection-low", type=float, default=None)
    g.add_argument("--rl-rejection-high", type=float, default=None)
    g.add_argument("--rl-icepop-low", type=float, default=None, help="IcePop: tokens whose train/rollout ratio is "
                   "outside [low, high] leave the loss, kept tokens are weighted by it")
    g.add_argument("--rl-icepop-high", type=float, default=None)
    g.add_argument("--rl-icepop-mask-only", action="store_true",
                   help="IcePop without the weight on the kept tokens (the mask only)")
    g.add_argument("--rl-eval-prompts", type=int, default=64,
                   help="held-out prompts (x4 samples) scored before the first and after the last step; 0 = none")
    g.add_argument("--rl-save-expert-usage", default=None, metavar="FILE",
                   help="write the tokens routed to each expert over the run (training passes, all ranks) as "
                        "convert_to_proxy.py's --usage-file JSON")
    g.add_argument("--rl-resume", action="store_true",
                   help="continue the RL run saved in --load (step, optimizer, RNG, reference policy, monitor "
                        "state; mindspeed_proxy/rl/resume.py); without it --load reads the weights only")
    g.add_argument("--rl-routing-replay", choices=list(MODES), default="off",
                   help="r2: replay the training pass's own first pass; r3: replay the rollout's routing")
    g.add_argument("--rl-gap-interval", type=int, default=0, metavar="N",
                   help="every N RL steps split the train-rollout logprob gap into expert flips, routing weights "
                        "and everything else (3 extra no-grad forwards of --rl-gap-samples rows); 0 = off")
    g.add_argument("--rl-gap-samples", type=int, default=8, help="rows per rank the gap decomposition runs on")
    g.add_argument("--rl-gap-layer-interval", type=int, default=0, metavar="N",
                   help="every N RL steps (a multiple of --rl-gap-interval) also attribute the flip term to each "
                        "MoE layer (one forward per layer); 0 = off")
    return p


def _check_rl(args, dp: int, world: int) -> None:
    """Range checks of the RL flags (finiteness is checked for every float flag before)."""
    positive = {"grpo_group_size": 2, "grpo_prompts_per_step": 1, "grpo_iterations": 1, "rl_max_new_tokens": 1,
                "rl_gap_interval": 0, "rl_gap_samples": 1, "rl_gap_layer_interval": 0}
    for name, least in positive.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise ArgumentError(f"--{name.replace('_', '-')} {value}: must be >= {least}")
    for name in ("grpo_clamp_eps_lower", "grpo_clamp_eps_upper", "grpo_kl_beta", "rl_default_temperature"):
        if getattr(args, name) < 0:
            raise ArgumentError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 0")
    if args.grpo_clamp_eps_lower >= 1:
        raise ArgumentError(f"--grpo-clamp-eps-lower {args.grpo_clamp_eps_lower}: must be < 1 (the lower bound "
                            "1 - eps must stay positive)")
    if not 0 <= args.rl_default_top_p <= 1:
        raise ArgumentError(f"--rl-default-top-p {args.rl_default_top_p}: must be in [0, 1] (0 = off)")
    if args.rl_default_top_p > 0 and args.rl_default_top_k > 0:
        raise ArgumentError("--rl-default-top-p and --rl-default-top-k exclude each other (as in Megatron-LM)")
    if args.rl_dual_clip is not None and args.rl_dual_clip <= 1:
        raise ArgumentError(f"--rl-dual-clip {args.rl_dual_clip}: must be > 1")
    coef = args.rl_importance_sampling_truncation_coef
    if coef is not None and coef <= 0:
        raise ArgumentError(f"--rl-importance-sampling-truncation-coef {coef}: must be > 0")
    if (coef is not None or args.rl_is_level) and not args.rl_inference_logprobs_is_correction:
        flag = "--rl-importance-sampling-truncation-coef" if coef is not None else "--rl-is-level"
        raise ArgumentError(f"{flag} acts on the IS correction: add --rl-inference-logprobs-is-correction "
                            "(as in Megatron-LM, where the coefficient alone does nothing)")
    for prefix in ("icepop", "rejection"):
        low, high = getattr(args, f"rl_{prefix}_low"), getattr(args, f"rl_{prefix}_high")
        if (low is None) != (high is None):
            raise ArgumentError(f"--rl-{prefix}-low and --rl-{prefix}-high go together")
        if low is not None and not 0 <= low <= high:
            raise ArgumentError(f"--rl-{prefix}-low {low} --rl-{prefix}-high {high}: need 0 <= low <= high")
    if (args.rl_rejection_level is None) != (args.rl_rejection_low is None):
        raise ArgumentError("--rl-rejection-level goes with --rl-rejection-low/--rl-rejection-high")
    if args.rl_icepop_low is not None and args.rl_rejection_level is not None:
        raise ArgumentError("--rl-icepop-low/high is token rejection: it excludes --rl-rejection-level")
    if args.rl_icepop_mask_only and args.rl_icepop_low is None:
        raise ArgumentError("--rl-icepop-mask-only needs --rl-icepop-low/--rl-icepop-high")
    if args.rl_icepop_low is not None and not args.rl_icepop_mask_only and args.rl_inference_logprobs_is_correction \
            and (args.rl_is_level or "token") != "token":
        raise ArgumentError("IcePop weights tokens by their ratio: it excludes --rl-is-level "
                            f"{args.rl_is_level} (use --rl-icepop-mask-only)")
    if args.rl_ratio_type == "sequence":
        if args.rl_loss_aggregation not in (None, GSPO_AGGREGATION):
            raise ArgumentError(f"--rl-ratio-type sequence (GSPO) is a per-sequence objective: --rl-loss-aggregation "
                                f"{args.rl_loss_aggregation} would weight sequences by length; use {GSPO_AGGREGATION}")
        args.rl_loss_aggregation = GSPO_AGGREGATION
    args.rl_loss_aggregation = args.rl_loss_aggregation or "token-mean"
    layer_every, every = args.rl_gap_layer_interval, args.rl_gap_interval
    if layer_every and (not every or layer_every % every):
        raise ArgumentError(f"--rl-gap-layer-interval {layer_every}: must be a multiple of --rl-gap-interval {every}")
    if args.grpo_prompts_per_step % dp:
        raise ArgumentError(f"--grpo-prompts-per-step {args.grpo_prompts_per_step} is not divisible by the "
                            f"data-parallel size {dp} (world {world})")


def launch_world_size() -> int:
    """The world size the launcher announces (torchrun's WORLD_SIZE, 1 without one), read where a command starts."""
    text = os.environ.get("WORLD_SIZE", "1")
    if not text.isdigit() or int(text) < 1:
        raise ArgumentError(f"WORLD_SIZE={text!r}: expected a positive integer (set by the launcher)")
    return int(text)


def parse(argv, prog: str, rl: bool = True, world: int = 1) -> argparse.Namespace:
    """Parse and check everything that needs no process group, for a launch of `world` ranks (given, never read
    from the environment here; the process group is checked against it later); ArgumentError names the flag."""
    parser = build_parser(prog, rl)
    args = parser.parse_args(argv)
    A.check_finite(parser, args)
    if args.rl_task not in TASKS:
        raise ArgumentError(f"--rl-task {args.rl_task!r}: unknown task; known: {', '.join(TASKS)}")
    task = build_task(args.rl_task, args.rl_partial_credit)
    dp = world // max(args.tensor_model_parallel_size * args.pipeline_model_parallel_size, 1)
    if args.tensor_model_parallel_size != 1 or args.pipeline_model_parallel_size != 1:
        raise ArgumentError("the RL loop runs TP=1, PP=1 (EP, DP and the distributed optimizer are supported); "
                            f"got --tensor-model-parallel-size {args.tensor_model_parallel_size} "
                            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}")
    if rl:
        _check_rl(args, dp, world)
        new = args.rl_max_new_tokens or task.max_response_length
        args.rl_max_new_tokens = new
        need = task.prompt_length + new
        samples = args.grpo_prompts_per_step * args.grpo_group_size
        if args.global_batch_size is None:
            args.global_batch_size = samples
        if samples * args.grpo_iterations % args.global_batch_size:
            raise ArgumentError(f"--grpo-group-size x --grpo-prompts-per-step x --grpo-iterations = "
                                f"{samples * args.grpo_iterations} is not divisible by --global-batch-size "
                                f"{args.global_batch_size}")
        if args.global_batch_size > samples:
            raise ArgumentError(f"--global-batch-size {args.global_batch_size} exceeds one step's rollouts {samples}")
        if samples % args.global_batch_size:
            raise ArgumentError(f"--global-batch-size {args.global_batch_size} does not divide one step's "
                                f"{samples} rollouts")
    else:
        need = task.prompt_length + task.max_response_length
        if args.global_batch_size is None:
            args.global_batch_size = 32
    per_rank = args.global_batch_size // max(dp, 1)
    if args.global_batch_size % max(dp, 1):
        raise ArgumentError(f"--global-batch-size {args.global_batch_size} is not divisible by the data-parallel "
                            f"size {dp}")
    args.micro_batch_size = min(args.micro_batch_size, per_rank or 1)
    if per_rank % args.micro_batch_size:
        raise ArgumentError(f"--micro-batch-size {args.micro_batch_size} does not divide the {per_rank} rows per "
                            f"data-parallel rank of --global-batch-size {args.global_batch_size}")
    args.seq_length = need  # the sampler's fixed buffer: every pass (SFT included) runs exactly this shape
    A.validate_static(args)
    return args


def correction(args: argparse.Namespace) -> Correction:
    """The train/rollout correction described by the IS, rejection and IcePop flags."""
    level = (args.rl_is_level or "token") if args.rl_inference_logprobs_is_correction else None
    if args.rl_icepop_low is not None:
        return Correction(is_level=level if args.rl_icepop_mask_only else "token",
                          truncation=args.rl_importance_sampling_truncation_coef, rejection="token",
                          low=args.rl_icepop_low, high=args.rl_icepop_high)
    return Correction(is_level=level, truncation=args.rl_importance_sampling_truncation_coef,
                      rejection=args.rl_rejection_level, low=args.rl_rejection_low, high=args.rl_rejection_high)


def grpo_config(args: argparse.Namespace) -> GRPOConfig:
    """The GRPOConfig described by `args`."""
    from mindspeed_proxy.rl.update import GRPOConfig  # the update imports megatron-core: not for parsing

    return GRPOConfig(
        group_size=args.grpo_group_size, prompts_per_step=args.grpo_prompts_per_step, iterations=args.grpo_iterations,
        clamp_eps_lower=args.grpo_clamp_eps_lower, clamp_eps_upper=args.grpo_clamp_eps_upper,
        kl_beta=args.grpo_kl_beta, entropy_weight=args.grpo_entropy_term_weight,
        filter_groups_with_same_reward=args.grpo_filter_groups_with_same_reward, kl_estimator=args.grpo_kl_estimator,
        aggregation=args.rl_loss_aggregation, dual_clip=args.rl_dual_clip, correction=correction(args),
        ratio_type=args.rl_ratio_type, routing_replay=args.rl_routing_replay, temperature=args.rl_default_temperature)
