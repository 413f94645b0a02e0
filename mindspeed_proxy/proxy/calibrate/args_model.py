"""The original model of a Megatron-LM checkpoint, built from the checkpoint's own args with megatron-core.

What Megatron-LM's `core_transformer_config_from_args` and `gpt_builder` do, at TP = PP = EP = 1 and on
eager paths: every TransformerConfig field the args carry, the few fields Megatron-LM derives from its
flags (activation, query groups, expert count), megatron-core's local decoder block spec with the args'
normalization, and GPTModel with the args' vocabulary, embedding tying and position embedding; bf16 /
fp16 models wrapped in Float16Module as Megatron-LM wraps them. Used for the calibration forward of
`--features outputs` when the args come from Megatron-LM (they carry `use_legacy_models`).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from mindspeed_proxy.proxy.core.errors import ConversionError

# the parallel layout of one process, and the eager (unfused) paths of a CPU / any-device forward
_WORLD_1 = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                expert_tensor_parallel_size=1, context_parallel_size=1, sequence_parallel=False,
                virtual_pipeline_model_parallel_size=None, num_layers_in_first_pipeline_stage=None,
                num_layers_in_last_pipeline_stage=None, pipeline_model_parallel_layout=None,
                account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False)
_EAGER = dict(bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
              apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
              cross_entropy_loss_fusion=False, moe_permute_fusion=False, use_cpu_initialization=True,
              perform_initialization=False, hidden_dropout=0.0, attention_dropout=0.0,
              deallocate_pipeline_outputs=False, cuda_graph_impl="none", recompute_granularity=None,
              recompute_method=None, recompute_num_layers=None)
# Megatron-LM features this builder does not build (their weights would not load into the local spec)
_UNSUPPORTED = (("use_legacy_models", "legacy model"), ("spec", "--spec"),
                ("heterogeneous_layers_config_path", "heterogeneous layers"),
                ("yaml_cfg", "--yaml-cfg"), ("experimental_attention_variant", "experimental attention variant"),
                ("moe_tp_extend_ep", "moe_tp_extend_ep"))


def from_megatron_lm(args) -> bool:
    """True for args written by Megatron-LM's own argument parser."""
    return hasattr(args, "use_legacy_models") and hasattr(args, "untie_embeddings_and_output_weights")


def check_supported(args) -> None:
    """ConversionError naming the first Megatron-LM feature of `args` this builder cannot build."""
    for name, what in _UNSUPPORTED:
        if getattr(args, name, None):
            raise ConversionError(f"--features outputs: the model of this checkpoint uses {what} ({name}="
                                  f"{getattr(args, name)!r}), which the converter's builder does not build; "
                                  "collect features during training and pass --features FILE")


def transformer_config(args):
    """megatron-core's TransformerConfig (MLATransformerConfig with MLA) from `args`, at world size 1."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    check_supported(args)
    cls = MLATransformerConfig if getattr(args, "multi_latent_attention", False) else TransformerConfig
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.init and hasattr(args, f.name)}
    kw.update(num_moe_experts=args.num_experts, pipeline_dtype=args.params_dtype,
              rotary_interleaved=getattr(args, "rotary_interleaved", False),
              num_query_groups=args.num_query_groups if args.group_query_attention else None)
    if args.swiglu:
        kw.update(activation_func=F.silu, gated_linear_unit=True)
    elif getattr(args, "squared_relu", False):
        from megatron.core.activations import squared_relu

        kw["activation_func"] = squared_relu
    elif getattr(args, "quick_geglu", False):
        from megatron.core.activations import quick_gelu

        kw.update(activation_func=quick_gelu, gated_linear_unit=True)
    if getattr(args, "rope_type", None) is None:
        kw.pop("rope_type", None)
    if isinstance(kw.get("cp_comm_type"), list) and len(kw["cp_comm_type"]) == 1:
        kw["cp_comm_type"] = kw["cp_comm_type"][0]
    kw.update(_WORLD_1, **_EAGER)
    kw = {k: v for k, v in kw.items() if k in {f.name for f in dataclasses.fields(cls)}}
    try:
        return cls(**kw)
    except (AssertionError, ValueError, TypeError) as exc:
        raise ConversionError(f"--features outputs: megatron-core refuses the model config of the checkpoint's "
                              f"args at world size 1 ({type(exc).__name__}: {exc}); pass --features FILE") from None


def build(args):
    """(model as Megatron-LM wraps it, the GPTModel inside) of `args`, on CPU, all experts, PP = 1, with the
    multi-token prediction block when the args have one (built from the decoder's last layer spec)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from mindspeed_proxy.tiny_moe import mtp_block_spec

    config = transformer_config(args)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                      qk_l2_norm=getattr(args, "qk_l2_norm", False))
    if config.multi_latent_attention:  # the local DotProductAttention cannot take MLA's q/k and value head dims
        from mindspeed_proxy.mla_attention import with_mla_core_attention

        spec = with_mla_core_attention(spec)
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                   max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
                   fp16_lm_cross_entropy=getattr(args, "fp16_lm_cross_entropy", False), parallel_output=True,
                   share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                   position_embedding_type=args.position_embedding_type,
                   rotary_percent=getattr(args, "rotary_percent", 1.0), rotary_base=getattr(args, "rotary_base", 10000),
                   rope_scaling=getattr(args, "use_rope_scaling", False), mtp_block_spec=mtp_block_spec(config, spec))
    if args.fp16 or args.bf16:
        from megatron.core.transformer.module import Float16Module

        return Float16Module(config, gpt), gpt
    return gpt, gpt


def tied_output(args, state: dict) -> dict:
    """`state` without the last stage's copy of the tied output weight (a PP = 1 model shares the embedding's),
    after checking the copy equals the embedding (Megatron-LM keeps them in sync)."""
    copy = state.get("output_layer.weight")
    if copy is None or args.untie_embeddings_and_output_weights:
        return state
    embedding = state.get("embedding.word_embeddings.weight")
    if embedding is not None and not torch.equal(copy, embedding):
        raise ConversionError("--features outputs: the last stage's tied output weight differs from the embedding "
                              "(embeddings tied in args); the checkpoint is inconsistent")
    return {k: v for k, v in state.items() if k != "output_layer.weight"}
