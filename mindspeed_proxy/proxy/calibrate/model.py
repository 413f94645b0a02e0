"""The calibration forward's model: any checkpoint's original model, from its own args, through megatron-core's spec API.

Args written by Megatron-LM go to `args_model` as they are. Args written by this project's trainer carry the
same field names but not the fields the trainer fixes (fp32 router, parameter dtype, MLA's value head width as
kv_channels): `model_args` adds them with the values the trainer trains with, so both reach the one builder
(megatron-core's TransformerConfig, its local decoder block spec with the args' normalization, MoE layer
pattern, shared experts, router, qk-layernorm, GQA or MLA). Options this process cannot build without
Transformer Engine or an accelerator are refused in one line naming the option.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util

import torch

from mindspeed_proxy.proxy.calibrate import args_model
from mindspeed_proxy.proxy.core.errors import ConversionError

_WHERE = "--features outputs"


def _trainer_defaults(args) -> dict:
    """The model fields our trainer fixes rather than records (older checkpoints lack some of them)."""
    dtype = torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) \
        else torch.float32
    mla = bool(getattr(args, "multi_latent_attention", False))
    heads = int(args.num_attention_heads)
    return dict(use_legacy_models=False, params_dtype=dtype, moe_router_dtype="fp32", transformer_impl="local",
                moe_router_load_balancing_type="aux_loss" if getattr(args, "moe_aux_loss_coeff", 0) else "none",
                kv_channels=int(args.v_head_dim) if mla else int(args.hidden_size) // heads,
                num_query_groups=heads if mla else getattr(args, "num_query_groups", heads),
                group_query_attention=not mla and getattr(args, "num_query_groups", heads) != heads,
                rotary_scaling_factor=1.0, rope_type=getattr(args, "rope_type", None) or "rope",
                normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope",
                untie_embeddings_and_output_weights=True, max_position_embeddings=getattr(args, "seq_length", None),
                moe_use_legacy_grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)))


def model_args(args) -> argparse.Namespace:
    """The checkpoint's args with every field the builder reads: Megatron-LM's unchanged, our trainer's completed
    (recorded fields win over the trainer's fixed values)."""
    if args_model.from_megatron_lm(args):
        return args
    try:
        defaults = _trainer_defaults(args)
    except AttributeError as exc:
        raise ConversionError(f"{_WHERE}: the checkpoint's args lack a model field ({exc}); pass --features FILE") \
            from None
    recorded = {k: v for k, v in vars(args).items() if v is not None or k not in defaults}
    return argparse.Namespace(**{**defaults, **recorded})


def _refuse(option: str, value, why: str) -> None:
    raise ConversionError(f"{_WHERE}: the checkpoint's {option}={value!r} cannot be built in this process ({why}); "
                          "collect features during training and pass --features FILE")


def check_buildable(args, checkpoint_format: str | None = None) -> None:
    """ConversionError naming the first option of (completed) `args` this process cannot build or load."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    args_model.check_supported(args)
    have_te = importlib.util.find_spec("transformer_engine") is not None
    for option in ("fp8", "fp4"):
        if getattr(args, option, None) and not have_te:
            _refuse(option, getattr(args, option), "needs Transformer Engine")
    if getattr(args, "moe_grouped_gemm", False):
        # the builder's local spec gives megatron-core's legacy GroupedMLP for a grouped GEMM, which is what a
        # local-impl run trained (Megatron-LM with --transformer-impl local, our trainer); a TE run trained
        # TEGroupedMLP, which is not built here
        legacy_gemm = "moe_use_legacy_grouped_gemm" in {f.name for f in dataclasses.fields(TransformerConfig)}
        local = getattr(args, "transformer_impl", "local") == "local" or \
            (legacy_gemm and getattr(args, "moe_use_legacy_grouped_gemm", False))
        from megatron.core.transformer.moe import experts

        if not (local and hasattr(experts, "GroupedMLP")):
            _refuse("moe_grouped_gemm", True, "the TE grouped GEMM; only the legacy GroupedMLP of a "
                    "--transformer-impl local run builds without Transformer Engine")
    if getattr(args, "multi_latent_attention", False):
        from mindspeed_proxy.mla_attention import q_norm_needs_te

        if q_norm_needs_te(getattr(args, "qk_layernorm", False), getattr(args, "q_lora_rank", None)):
            _refuse("qk_layernorm", True, "with MLA and q_lora_rank=None this megatron-core fuses the Q norm into "
                    "linear_q_proj, which needs Transformer Engine")
    if checkpoint_format == "torch" and getattr(args, "transformer_impl", "local") == "transformer_engine":
        _refuse("transformer_impl", "transformer_engine", "a legacy checkpoint keeps Transformer Engine's parameter "
                "names, which megatron-core's local layers do not load; convert its torch_dist form")


def model_config(args, checkpoint_format: str | None = None):
    """megatron-core's TransformerConfig of the checkpoint's model at world size 1, with `vocab_size` set;
    ConversionError when it cannot be built here."""
    args = model_args(args)
    check_buildable(args, checkpoint_format)
    config = args_model.transformer_config(args)
    config.vocab_size = args.padded_vocab_size
    return config


def build(args, checkpoint_format: str | None = None) -> tuple:
    """(model as Megatron wraps it, the GPTModel inside) of the checkpoint's args: all experts, PP = 1, this
    process's parallel_state (world of 1) must be initialised."""
    args = model_args(args)
    check_buildable(args, checkpoint_format)
    return args_model.build(args)
