"""Tiny megatron-core GPT-MoE models (GQA or MLA, RoPE, SwiGLU, RMSNorm) built with the local layer spec.

The same builder serves the tests, the example trainer and the demo, so a model in a test is the
model users train. Parallel sizes come from megatron's `parallel_state`, which must be initialised.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.nn.functional as F


@dataclass
class TinyMoEConfig:
    """Model shape and MoE settings of a tiny GPT-MoE (Megatron-LM argument names where they exist)."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 128
    num_experts: int = 8
    moe_ffn_hidden_size: int = 64
    moe_router_topk: int = 2
    moe_layer_freq: Union[int, list] = 1
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_score_function: str = "softmax"
    moe_grouped_gemm: bool = False  # True: legacy GroupedMLP (weight1/weight2), else SequentialMLP
    moe_token_dispatcher_type: str = "allgather"
    moe_aux_loss_coeff: float = 0.0
    moe_router_load_balancing_type: str = "none"
    seq_length: int = 64
    vocab_size: int = 264
    init_method_std: float = 0.02
    bf16: bool = False
    fp16: bool = False  # fp16 params with Megatron's dynamic loss scaling
    sequence_parallel: bool = False
    qk_layernorm: bool = False
    position_embedding_type: str = "rope"
    # DeepSeek multi-latent attention (megatron's MLATransformerConfig; q_lora_rank None = no query down-projection)
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 16
    qk_pos_emb_head_dim: int = 8
    v_head_dim: int = 16
    rope_type: str = "rope"  # MLA RoPE: "rope" or "yarn" (both run on CPU without fusion)
    mtp_num_layers: Optional[int] = None  # DeepSeek-V3 multi-token prediction layers (on the last pipeline stage)
    extra: dict = field(default_factory=dict)  # any other TransformerConfig field

    def replace(self, **changes) -> "TinyMoEConfig":
        """Return a copy with `changes` applied."""
        return dataclasses.replace(self, **changes)


def transformer_config(cfg: TinyMoEConfig):
    """Build megatron's TransformerConfig for `cfg` at the current parallel_state sizes."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32
    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.hidden_size // cfg.num_attention_heads,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        qk_layernorm=cfg.qk_layernorm,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        sequence_parallel=cfg.sequence_parallel,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=dtype,
        bf16=cfg.bf16,
        fp16=cfg.fp16,
        pipeline_dtype=dtype,
        autocast_dtype=dtype if cfg.bf16 or cfg.fp16 else None,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    if cfg.num_experts:
        kwargs.update(
            num_moe_experts=cfg.num_experts,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
            moe_router_topk=cfg.moe_router_topk,
            moe_layer_freq=cfg.moe_layer_freq,
            moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
            moe_router_enable_expert_bias=cfg.moe_router_enable_expert_bias,
            moe_router_score_function=cfg.moe_router_score_function,
            moe_grouped_gemm=cfg.moe_grouped_gemm,
            moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            moe_router_load_balancing_type=cfg.moe_router_load_balancing_type,
            moe_router_dtype="fp32",
        )
        kwargs.update(_legacy_grouped_gemm(cfg, TransformerConfig))
    if cfg.multi_latent_attention:
        _check_mla_q_norm(cfg)
        kwargs.update(
            multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
            qk_head_dim=cfg.qk_head_dim, qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
            rope_type=cfg.rope_type, rotary_scaling_factor=1.0,
            num_query_groups=cfg.num_attention_heads,  # MLA keys are per head (DotProductAttention repeats groups)
            kv_channels=cfg.v_head_dim,
        )
    if cfg.mtp_num_layers:
        kwargs.update(mtp_num_layers=cfg.mtp_num_layers)
    kwargs.update(cfg.extra)
    return (MLATransformerConfig if cfg.multi_latent_attention else TransformerConfig)(**kwargs)


def _legacy_grouped_gemm(cfg: TinyMoEConfig, config_class) -> dict:
    """The legacy GroupedMLP switch where megatron-core has it (< 0.17); refuse grouped GEMM where it is TE-only."""
    if "moe_use_legacy_grouped_gemm" in {f.name for f in dataclasses.fields(config_class)}:
        return {"moe_use_legacy_grouped_gemm": cfg.moe_grouped_gemm}
    if cfg.moe_grouped_gemm:
        raise ValueError("moe_grouped_gemm: this megatron-core has no legacy GroupedMLP (gone from 0.17); its "
                         "grouped GEMM needs Transformer Engine")
    return {}


def _check_mla_q_norm(cfg: TinyMoEConfig) -> None:
    """megatron-core 0.19 gives MLA without q_lora_rank a Q norm fused into linear_q_proj (TE-only): refuse on CPU."""
    from mindspeed_proxy.mla_attention import q_norm_needs_te

    if q_norm_needs_te(cfg.qk_layernorm, cfg.q_lora_rank):
        raise ValueError("multi_latent_attention with qk_layernorm and q_lora_rank=None: this megatron-core (0.19+) "
                         "fuses a Q norm into linear_q_proj, which needs Transformer Engine; set q_lora_rank or "
                         "qk_layernorm=False")


def layer_spec(config, vp_stage: Optional[int] = None):
    """Return megatron's local GPT decoder block spec for `config` (model chunk `vp_stage`), with SP-capable norms
    (and, for MLA, a local core attention that takes MLA's q/k and value head dims)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from mindspeed_proxy.norms import with_sequence_parallel_norms

    spec = with_sequence_parallel_norms(
        get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                   vp_stage=vp_stage)
    )
    if getattr(config, "multi_latent_attention", False):
        from mindspeed_proxy.mla_attention import with_mla_core_attention

        spec = with_mla_core_attention(spec)
    return spec


def build_model(cfg: TinyMoEConfig, config=None, vp_stage: Optional[int] = None):
    """Build this rank's GPTModel chunk (pre/post process from the pipeline stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    config = config or transformer_config(cfg)
    pre = ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    post = ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    spec = layer_spec(config, vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        pre_process=pre,
        post_process=post,
        position_embedding_type=cfg.position_embedding_type,
        share_embeddings_and_output_weights=False,
        vp_stage=vp_stage,
        mtp_block_spec=mtp_block_spec(config, spec, vp_stage),
    )
    if cfg.bf16 or cfg.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def mtp_block_spec(config, spec, vp_stage: Optional[int] = None):
    """megatron's MTP block spec (local backend, the decoder's last layer spec) on the stage that holds the MTP
    layers, else None (as Megatron-LM's gpt_builder builds it)."""
    if not getattr(config, "mtp_num_layers", None):
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)
