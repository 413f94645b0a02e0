"""Command-line arguments of the example trainer, with Megatron-LM's flag names and `args` field names."""
from __future__ import annotations

import argparse
import os

from mindspeed_proxy.tiny_moe import TinyMoEConfig
from mindspeed_proxy.training.engine import TrainConfig


class ArgumentError(ValueError):
    """A flag value that cannot work; reported as one line before anything is written."""


def build_parser(prog: str = "train_moe.py") -> argparse.ArgumentParser:
    """The trainer's parser (a subset of Megatron-LM's flags, same spelling and defaults' meaning)."""
    p = argparse.ArgumentParser(prog=prog, description="Train a tiny megatron-core GPT-MoE (CPU or accelerator).",
                                allow_abbrev=False)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved (virtual) pipeline: layers per model chunk; chunks `model0`, `model1`, ...")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=128)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=2)
    g.add_argument("--num-experts", type=int, default=8)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=64)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-layer-freq", type=int, default=1)
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true")
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax")
    g.add_argument("--moe-grouped-gemm", action="store_true", help="legacy GroupedMLP (bf16 only)")
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default="allgather")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--qk-layernorm", action="store_true",
                   help="q/k layernorm (GQA); with MLA the norms of the query and key/value latents")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek multi-latent attention (megatron's MLASelfAttention, MLATransformerConfig)")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="MLA query latent rank (default: no query down-projection)")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="MLA key/value latent rank")
    g.add_argument("--qk-head-dim", type=int, default=16, help="MLA q/k head dim without RoPE (Megatron-LM: 128)")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=8,
                   help="MLA decoupled RoPE head dim, one key shared by all heads (Megatron-LM: 64)")
    g.add_argument("--v-head-dim", type=int, default=16, help="MLA value head dim (Megatron-LM: 128)")
    g.add_argument("--rope-type", choices=["rope", "yarn"], default=None,
                   help="MLA RoPE variant (default here: rope; Megatron-LM's MLA default is yarn, which the CPU "
                        "platform also builds)")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="multi-token prediction layers (DeepSeek-V3; megatron's MTP block on the last pipeline stage)")
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true", help="fp16 params with dynamic loss scaling")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=8)
    g.add_argument("--train-iters", type=int, default=300)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=10)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad",
                   help="a step whose loss or gradient is NaN/inf is never applied; by default (Megatron-LM's "
                        "check) the run stops naming it, with this flag the step is skipped and counted")
    g = p.add_argument_group("data, checkpoints and logging")
    g.add_argument("--data-path", default=None, help="Megatron indexed dataset prefix (PREFIX.bin/.idx); "
                   "default: the embedded Python-stdlib corpus")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="the iteration of --load to load (default: the one its latest_checkpointed_iteration.txt names)")
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist"], default="torch_dist")
    g.add_argument("--finetune", action="store_true", help="load weights only, start at iteration 0")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--log-dir", default=None, help="metrics.jsonl goes here (default: beside --save, "
                   "else ./runs/<timestamp>)")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--tensorboard-dir", default=None, help="TensorBoard event files (needs the tensorboard "
                   "package): the loop's scalars, and the monitor's (unless its config's sinks leave out tensorboard)")
    g.add_argument("--device", choices=["cpu", "cuda", "npu"], default=None,
                   help="platform (default: MINDSPEED_PROXY_DEVICE, else auto-detect)")
    from mindspeed_proxy.monitor.arguments import add_monitor_arguments

    return add_monitor_arguments(p)


def check_finite(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a NaN or inf value of any float flag (raises ArgumentError naming the flag)."""
    import math

    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.type is float and isinstance(value, float) and not math.isfinite(value):
            raise ArgumentError(f"{action.option_strings[0]} {value}: not a finite number")


def validate_static(args: argparse.Namespace) -> None:
    """Checks that need no process group; raises ArgumentError naming the flag and the value."""
    if getattr(args, "mechanism_routing_replay", "off") != "off":
        raise ArgumentError("--mechanism-routing-replay is for Megatron-LM's train_rl.py; this loop replays with "
                            "--rl-routing-replay r3")
    if getattr(args, "mechanism_monitor_rl_gap_interval", 0):
        raise ArgumentError("--mechanism-monitor-rl-gap-interval is for Megatron-LM's train_rl.py; this loop "
                            "decomposes the gap with --rl-gap-interval")
    if getattr(args, "mechanism_offset_sampling_seed_by_dp_rank", False):
        raise ArgumentError("--mechanism-offset-sampling-seed-by-dp-rank is for Megatron-LM's train_rl.py (its "
                            "dynamic engines); this loop draws distinct random numbers for every sample")
    if args.num_experts and args.num_experts % args.expert_model_parallel_size:
        raise ArgumentError(
            f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size "
            f"{args.expert_model_parallel_size}"
        )
    if args.num_experts and args.moe_router_topk > args.num_experts:
        raise ArgumentError(f"--moe-router-topk {args.moe_router_topk} exceeds --num-experts {args.num_experts}")
    if args.num_attention_heads % args.num_query_groups:
        raise ArgumentError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                            f"--num-query-groups {args.num_query_groups}")
    if args.load is not None and not os.path.isdir(args.load):
        raise ArgumentError(f"--load {args.load}: no such directory")
    if args.global_batch_size % args.micro_batch_size:
        raise ArgumentError(f"--global-batch-size {args.global_batch_size} is not divisible by "
                            f"--micro-batch-size {args.micro_batch_size}")
    if args.lr_warmup_iters >= args.train_iters:
        raise ArgumentError(f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --train-iters "
                            f"{args.train_iters}")
    if args.mtp_num_layers is not None and args.mtp_num_layers < 1:
        raise ArgumentError(f"--mtp-num-layers {args.mtp_num_layers}: must be at least 1")
    if args.bf16 and args.fp16:
        raise ArgumentError("--bf16 and --fp16 exclude each other")
    if args.moe_grouped_gemm and not args.bf16:
        raise ArgumentError("--moe-grouped-gemm (legacy GroupedMLP) needs --bf16 in megatron-core")
    if args.multi_latent_attention and args.tensor_model_parallel_size > 1:
        # megatron-core 0.16.1's local MLA gathers linear_kv_down_proj's TP-sharded output and splits the
        # gradient back, so the RoPE key rows only get the gradient of their own rank's heads (docs/monitor.md)
        raise ArgumentError(f"--multi-latent-attention with --tensor-model-parallel-size "
                            f"{args.tensor_model_parallel_size}: megatron-core's local MLA computes a wrong gradient "
                            "for the shared RoPE key rows at TP > 1; use TP = 1")
    if args.tensor_model_parallel_size > 1 and args.num_experts:
        args.sequence_parallel = True  # megatron-core requires SP for MoE with TP > 1


def validate_world(args: argparse.Namespace, world_size: int) -> None:
    """Checks against the launched world size; fills Megatron's derived fields (world/data-parallel size)."""
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if world_size % model_parallel:
        raise ArgumentError(f"world size {world_size} is not divisible by --tensor-model-parallel-size x "
                            f"--pipeline-model-parallel-size = {model_parallel}")
    dp = world_size // model_parallel
    if dp % args.expert_model_parallel_size:
        raise ArgumentError(f"--expert-model-parallel-size {args.expert_model_parallel_size} does not divide "
                            f"the data-parallel size {dp} (world {world_size} / TP x PP {model_parallel})")
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ArgumentError(f"--global-batch-size {args.global_batch_size} is not divisible by "
                            f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}")
    if args.num_layers % args.pipeline_model_parallel_size:
        raise ArgumentError(f"--num-layers {args.num_layers} is not divisible by "
                            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}")
    per_vp = args.num_layers_per_virtual_pipeline_stage
    if per_vp is not None and (args.pipeline_model_parallel_size < 2 or per_vp < 1 or
                               (args.num_layers // args.pipeline_model_parallel_size) % per_vp):
        raise ArgumentError(f"--num-layers-per-virtual-pipeline-stage {per_vp} needs "
                            "--pipeline-model-parallel-size > 1 and must divide the layers per stage "
                            f"{args.num_layers // args.pipeline_model_parallel_size}")
    micro = args.global_batch_size // (args.micro_batch_size * dp)
    if per_vp is not None and micro % args.pipeline_model_parallel_size:
        raise ArgumentError(f"interleaved pipeline: {micro} micro-batches per data-parallel rank must be a multiple "
                            f"of --pipeline-model-parallel-size {args.pipeline_model_parallel_size} (megatron's "
                            "interleaved schedule)")
    vocab = TinyMoEConfig().vocab_size
    if vocab % args.tensor_model_parallel_size:
        raise ArgumentError(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} does not divide "
                            f"the padded vocabulary size {vocab}")
    args.world_size = world_size
    args.data_parallel_size = dp
    args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    args.virtual_pipeline_model_parallel_size = (
        None if per_vp is None else args.num_layers // args.pipeline_model_parallel_size // per_vp)
    args.use_dist_ckpt = args.ckpt_format == "torch_dist"
    args.padded_vocab_size = model_config(args).vocab_size
    if args.multi_latent_attention:  # MLA keys are per head
        args.num_query_groups = args.num_attention_heads
        args.rope_type = args.rope_type or "rope"
    args.group_query_attention = args.num_query_groups != args.num_attention_heads
    args.add_bias_linear = False
    args.untie_embeddings_and_output_weights = True  # the tiny model never ties (tiny_moe.py)
    args.normalization = "RMSNorm"
    args.position_embedding_type = "rope"
    args.swiglu = True
    args.transformer_impl = "local"
    args.moe_use_legacy_grouped_gemm = args.moe_grouped_gemm
    # what tiny_moe fixes, recorded so the converter's calibration forward rebuilds this model from args alone
    args.moe_router_dtype = "fp32"
    args.moe_router_load_balancing_type = "aux_loss" if args.moe_aux_loss_coeff else "none"
    args.kv_channels = args.v_head_dim if args.multi_latent_attention else args.hidden_size // args.num_attention_heads
    args.rotary_scaling_factor = 1.0
    args.moe_router_num_groups = None
    args.moe_tp_extend_ep = False
    args.max_position_embeddings = args.seq_length


def model_config(args: argparse.Namespace) -> TinyMoEConfig:
    """The TinyMoEConfig described by `args`."""
    return TinyMoEConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size,
        num_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk, moe_layer_freq=args.moe_layer_freq,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_score_function=args.moe_router_score_function,
        moe_grouped_gemm=args.moe_grouped_gemm, moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if args.moe_aux_loss_coeff else "none",
        seq_length=args.seq_length, qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        multi_latent_attention=bool(getattr(args, "multi_latent_attention", False)),
        q_lora_rank=getattr(args, "q_lora_rank", None), kv_lora_rank=getattr(args, "kv_lora_rank", 32),
        qk_head_dim=getattr(args, "qk_head_dim", 16), qk_pos_emb_head_dim=getattr(args, "qk_pos_emb_head_dim", 8),
        v_head_dim=getattr(args, "v_head_dim", 16), rope_type=getattr(args, "rope_type", None) or "rope",
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
        bf16=args.bf16, fp16=args.fp16, sequence_parallel=args.sequence_parallel,
        extra=({"virtual_pipeline_model_parallel_size": vpp}
               if (vpp := getattr(args, "virtual_pipeline_model_parallel_size", None)) else {}),
    )


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig described by `args`."""
    return TrainConfig(
        lr=args.lr, min_lr=min(args.min_lr, args.lr), lr_warmup_iters=args.lr_warmup_iters,
        lr_decay_style=args.lr_decay_style, train_iters=args.train_iters, weight_decay=args.weight_decay,
        clip_grad=args.clip_grad, micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size, use_distributed_optimizer=args.use_distributed_optimizer,
        seed=args.seed,
    )
