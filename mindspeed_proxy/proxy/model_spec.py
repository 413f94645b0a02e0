"""The shapes the planner counts: one ModelSpec from a Hugging Face config.json or a Megatron args set."""
from __future__ import annotations

import argparse
import ast
import os
from dataclasses import dataclass, field
from typing import Optional

from mindspeed_proxy.proxy.core.errors import ConversionError, read_json_object
from mindspeed_proxy.proxy.io.hf import layout as hf_layout


@dataclass(frozen=True)
class MLA:
    """DeepSeek multi-latent attention ranks (q_lora_rank None: no query down-projection)."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_head_dim: int      # per head, without RoPE part (HF qk_nope_head_dim)
    qk_pos_emb_head_dim: int  # decoupled RoPE part (HF qk_rope_head_dim)
    v_head_dim: int


@dataclass(frozen=True)
class ModelSpec:
    """Every shape that sets the parameter count, FLOPs and activation size of a GPT-MoE model."""

    name: str
    num_layers: int
    hidden: int
    vocab: int
    tied: bool
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int                    # dense layers' intermediate size
    num_experts: int
    topk: int
    moe_ffn: int                # one routed expert's intermediate size
    moe_layers: tuple           # one bool per decoder layer
    shared_ffn: int = 0         # intermediate size of the shared expert(s), summed
    shared_gate: bool = False   # Qwen2-MoE's sigmoid gate on the shared expert ([1, H])
    router_bias: bool = False   # expert_bias / e_score_correction_bias [E]
    mla: Optional[MLA] = None
    qk_norm: bool = False       # q/k norms per head (GQA); the latent norms (MLA)
    gated: bool = True          # SwiGLU: 3 matrices per MLP
    layernorm: bool = False     # LayerNorm (weight + bias) instead of RMSNorm (weight)
    bias_linear: bool = False
    qkv_bias: bool = False
    mtp_layers: int = 0         # multi-token-prediction layers: reported, not counted (DeepSeek's 671B excludes them)
    tp_extend_ep: bool = False
    routing: argparse.Namespace = field(default_factory=argparse.Namespace)  # what plan.rules_from_args reads
    seq_length: Optional[int] = None
    micro_batch: Optional[int] = None
    global_batch: Optional[int] = None
    layout: dict = field(default_factory=dict)  # tp/pp/ep/dp recorded with the model (Megatron args), if any

    @property
    def num_moe_layers(self) -> int:
        """Decoder layers with routed experts."""
        return sum(self.moe_layers)


def _int(config: dict, name: str, where: str, default=None) -> int:
    value = config.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConversionError(f"{where}: {name} {value!r} is not a non-negative integer")
    return value


def from_hf_config(config: dict, where: str) -> ModelSpec:
    """ModelSpec of a Hugging Face config.json (qwen2_moe, qwen3_moe, mixtral, deepseek_v2, deepseek_v3)."""
    num_experts = hf_layout.expert_count(config, where)
    routing = hf_layout.routing_args(config, num_experts, where)  # also refuses an unsupported model_type
    model_type = config["model_type"]
    n = _int(config, "num_hidden_layers", where)
    h = _int(config, "hidden_size", where)
    heads = _int(config, "num_attention_heads", where)
    moe = hf_layout.expected_moe_layers(config)
    common = dict(name=config.get("_name_or_path") or model_type, num_layers=n, hidden=h,
                  vocab=_int(config, "vocab_size", where), tied=bool(config.get("tie_word_embeddings", False)),
                  heads=heads, kv_heads=_int(config, "num_key_value_heads", where, heads),
                  head_dim=_int(config, "head_dim", where) if config.get("head_dim") else h // heads,
                  ffn=_int(config, "intermediate_size", where), num_experts=num_experts, topk=routing.moe_router_topk,
                  moe_layers=tuple(i in moe for i in range(n)), routing=routing)
    if model_type == "mixtral":
        return ModelSpec(**common, moe_ffn=common["ffn"])
    moe_ffn = _int(config, "moe_intermediate_size", where)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        shared = config.get("shared_expert_intermediate_size") or 0
        return ModelSpec(**common, moe_ffn=moe_ffn, shared_ffn=shared, shared_gate=bool(shared),
                         qk_norm=model_type == "qwen3_moe",
                         qkv_bias=model_type == "qwen2_moe")
    mla = MLA(config.get("q_lora_rank"), _int(config, "kv_lora_rank", where), _int(config, "qk_nope_head_dim", where),
              _int(config, "qk_rope_head_dim", where), _int(config, "v_head_dim", where))
    return ModelSpec(**common, moe_ffn=moe_ffn, shared_ffn=moe_ffn * (config.get("n_shared_experts") or 0),
                     router_bias=model_type == "deepseek_v3", mla=mla, qk_norm=True,  # q_a/kv_a_layernorm
                     mtp_layers=config.get("num_nextn_predict_layers") or 0)


def read_hf_config(path: str) -> ModelSpec:
    """ModelSpec of a config.json file, or of the config.json inside folder `path`."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    return from_hf_config(read_json_object(file, f"--hf-config {path}"), file)


def moe_pattern(value, num_layers: int, where: str) -> tuple:
    """Megatron's --moe-layer-freq: N (layer i is MoE when i % N == 0), a list, or a list expression string."""
    if isinstance(value, str):
        value = value.strip()
        value = _eval_pattern(value, where) if "[" in value else _positive(value, where)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return tuple(i % value == 0 for i in range(num_layers))
    if isinstance(value, (list, tuple)) and len(value) == num_layers and all(v in (0, 1) for v in value):
        return tuple(bool(v) for v in value)
    raise ConversionError(f"{where}: moe_layer_freq {value!r} is neither N > 0 nor a 0/1 list of {num_layers} layers")


def _positive(text: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ConversionError(f"{where}: moe_layer_freq {text!r} is not a positive integer or a list expression")
    return int(text)


def _eval_pattern(text: str, where: str) -> list:
    """A list expression like ([0]*3+[1]*58), evaluated without eval(): lists, ints, + and * only."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.List):
            return [walk(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = walk(node.left), walk(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(ast.dump(node))
    try:
        value = walk(ast.parse(text, mode="eval"))
    except (SyntaxError, ValueError, TypeError) as exc:
        raise ConversionError(f"{where}: moe_layer_freq {text!r} is not a list expression ({exc})") from None
    if not isinstance(value, list):
        raise ConversionError(f"{where}: moe_layer_freq {text!r} does not evaluate to a list")
    return value


def _get(args, name, default=None):
    value = getattr(args, name, None)
    return default if value is None else value


def from_megatron_args(args, where: str) -> ModelSpec:
    """ModelSpec of a Megatron args set (a checkpoint's `args` or parsed Megatron-LM flags), with Megatron's
    defaults: ffn_hidden_size 4h (SwiGLU: 8h/3 rounded down to 64), kv_channels h/heads, moe_ffn = ffn."""
    missing = [f for f in ("num_layers", "hidden_size", "num_attention_heads", "num_experts") if not _get(args, f)]
    if missing:
        raise ConversionError(f"{where}: no {', '.join(missing)} (the planner needs an MoE model's shapes)")
    n, h, heads = int(args.num_layers), int(args.hidden_size), int(args.num_attention_heads)
    swiglu = bool(_get(args, "swiglu", False))
    ffn = _get(args, "ffn_hidden_size") or (int(4 * h * 2 / 3 / 64) * 64 if swiglu else 4 * h)
    vocab = _get(args, "padded_vocab_size")
    if not vocab:  # Megatron pads the tokenizer's vocabulary to a multiple of make_vocab_size_divisible_by x TP
        if not _get(args, "vocab_size"):
            raise ConversionError(f"{where}: no padded_vocab_size / --vocab-size")
        multiple = int(_get(args, "make_vocab_size_divisible_by", 128)) * \
            int(_get(args, "tensor_model_parallel_size", 1))
        vocab = -(-int(args.vocab_size) // multiple) * multiple
    mla = None
    if _get(args, "multi_latent_attention", False):
        mla = MLA(_get(args, "q_lora_rank"), int(_get(args, "kv_lora_rank", 32)), int(_get(args, "qk_head_dim", 128)),
                  int(_get(args, "qk_pos_emb_head_dim", 64)), int(_get(args, "v_head_dim", 128)))
    gqa = bool(_get(args, "group_query_attention", False))  # Megatron ignores num_query_groups without it
    routing = argparse.Namespace(**{k: getattr(args, k, None) for k in (
        "moe_router_topk", "moe_router_num_groups", "moe_router_group_topk", "moe_router_min_experts_per_group")})
    routing.moe_router_topk = int(_get(args, "moe_router_topk", 2))
    layout = {k: int(_get(args, f, d)) for k, f, d in (
        ("tp", "tensor_model_parallel_size", 1), ("pp", "pipeline_model_parallel_size", 1),
        ("ep", "expert_model_parallel_size", 1))}
    dp = _get(args, "data_parallel_size") or (_get(args, "world_size") and
                                             int(args.world_size) // (layout["tp"] * layout["pp"]))
    if dp:
        layout["dp"] = int(dp)
    return ModelSpec(
        name=where, num_layers=n, hidden=h, vocab=int(vocab),
        tied=not _get(args, "untie_embeddings_and_output_weights", False), heads=heads,
        kv_heads=int(_get(args, "num_query_groups", heads)) if gqa else heads,
        head_dim=int(_get(args, "kv_channels") or h // heads), ffn=int(ffn), num_experts=int(args.num_experts),
        topk=routing.moe_router_topk, moe_ffn=int(_get(args, "moe_ffn_hidden_size") or ffn),
        moe_layers=moe_pattern(_get(args, "moe_layer_freq", 1), n, where),
        shared_ffn=int(_get(args, "moe_shared_expert_intermediate_size", 0)),
        shared_gate=bool(_get(args, "moe_shared_expert_gate", False)),
        router_bias=bool(_get(args, "moe_router_enable_expert_bias", False)), mla=mla,
        qk_norm=bool(_get(args, "qk_layernorm", False)), gated=swiglu,
        layernorm=_get(args, "normalization", "LayerNorm") == "LayerNorm",
        bias_linear=bool(_get(args, "add_bias_linear", True)),
        qkv_bias=bool(_get(args, "add_qkv_bias", False) or _get(args, "add_bias_linear", True)),
        mtp_layers=int(_get(args, "mtp_num_layers", 0)), tp_extend_ep=bool(_get(args, "moe_tp_extend_ep", False)),
        routing=routing, seq_length=_get(args, "seq_length"), micro_batch=_get(args, "micro_batch_size"),
        global_batch=_get(args, "global_batch_size"), layout=layout)


def read_checkpoint_args(load: str, iteration: Optional[int] = None) -> argparse.Namespace:
    """The `args` a Megatron checkpoint recorded (legacy: the first mp_rank file; torch_dist: common.pt), read with
    the converter's iteration resolution and safe loader; no tensor is read."""
    from mindspeed_proxy.checkpoint_io import safe_torch_load
    from mindspeed_proxy.proxy.core.tracker import resolve_iteration
    from mindspeed_proxy.proxy.io.legacy.reader import FILE

    _, folder = resolve_iteration(load, iteration)
    names = os.listdir(folder)
    if "common.pt" in names:
        path = os.path.join(folder, "common.pt")
    else:
        ranks = sorted(n for n in names if n.startswith("mp_rank_"))
        if not ranks:
            raise ConversionError(f"--load {load}: {folder} holds neither common.pt nor mp_rank_* folders")
        path = os.path.join(folder, ranks[0], FILE)
    try:
        state = safe_torch_load(path, mmap=path.endswith(FILE))
    except Exception as exc:
        raise ConversionError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or "args" not in state:
        raise ConversionError(f"{path}: no 'args' recorded")
    return state["args"]
