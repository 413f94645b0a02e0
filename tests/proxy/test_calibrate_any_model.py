"""The calibration forward (`--features outputs`, `--selection reconstruction`) on GPT-MoE models the tiny example
cannot build: built here with megatron-core's own API (local spec), saved as Megatron-LM saves them (torch_dist
through dist_checkpointing, legacy through torch.save), converted through the CLI."""
import argparse
import json
import os

import numpy as np
import pytest
import torch

from mindspeed_proxy.proxy.calibrate import forward as outputs
from mindspeed_proxy.proxy.cli import main
from mindspeed_proxy.proxy.convert import open_checkpoint
from mindspeed_proxy.testing import run_distributed

E, TOPK, H, SEQ = 8, 2, 64, 32
# LayerNorm, GQA + qk-layernorm, layer 0 dense, shared expert, sigmoid router with expert bias, tied embeddings
DENSE_FIRST = dict(normalization="LayerNorm", num_layers=3, moe_layer_freq=[0, 1, 1], group_query_attention=True,
                   num_query_groups=2, qk_layernorm=True, moe_shared_expert_intermediate_size=48,
                   moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                   untie_embeddings_and_output_weights=False, moe_router_dtype="fp32")
# DeepSeek multi-latent attention (query and key/value latents) with their layernorms, RMSNorm, softmax router
MLA = dict(normalization="RMSNorm", num_layers=2, moe_layer_freq=1, multi_latent_attention=True, q_lora_rank=16,
           kv_lora_rank=24, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, qk_layernorm=True,
           rope_type="rope", rotary_scaling_factor=1.0, moe_router_score_function="softmax",
           group_query_attention=False, num_query_groups=None, untie_embeddings_and_output_weights=True)
CASES = {"dense_first": DENSE_FIRST, "mla": MLA}


def megatron_lm_args(case: str) -> argparse.Namespace:
    """The args Megatron-LM's parser records for this model (its field names; TP = PP = EP = 1, torch_dist)."""
    args = argparse.Namespace(
        use_legacy_models=False, transformer_impl="local", num_layers=None, hidden_size=H, ffn_hidden_size=128,
        num_attention_heads=4, kv_channels=16, num_experts=E, moe_ffn_hidden_size=64, moe_router_topk=TOPK,
        swiglu=True, add_bias_linear=False, add_qkv_bias=False, position_embedding_type="rope", rotary_base=10000,
        rotary_percent=1.0, seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=256, vocab_size=256,
        make_vocab_size_divisible_by=128, params_dtype=torch.float32, fp16=False, bf16=False,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, world_size=1, data_parallel_size=1, micro_batch_size=2,
        global_batch_size=2, moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, init_method_std=0.02, hidden_dropout=0.0,
        attention_dropout=0.0, ckpt_format="torch_dist", iteration=1, multi_latent_attention=False,
        moe_shared_expert_intermediate_size=None, moe_router_enable_expert_bias=False)
    for key, value in CASES[case].items():
        setattr(args, key, value)
    return args


def _build_direct(args):
    """The model of `args` through megatron-core's API directly (not the converter's builder), initialised."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from mindspeed_proxy.mla_attention import with_mla_core_attention

    kw = dict(num_layers=args.num_layers, hidden_size=H, ffn_hidden_size=128, num_attention_heads=4,
              num_query_groups=args.num_query_groups, normalization=args.normalization, qk_layernorm=True,
              gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
              attention_dropout=0.0, num_moe_experts=E, moe_ffn_hidden_size=64, moe_router_topk=TOPK,
              moe_layer_freq=args.moe_layer_freq, moe_router_score_function=args.moe_router_score_function,
              moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
              use_cpu_initialization=True, bias_dropout_fusion=False, apply_rope_fusion=False,
              masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
    if args.multi_latent_attention:
        config = MLATransformerConfig(**kw, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=24,
                                      qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="rope",
                                      rotary_scaling_factor=1.0, kv_channels=16)
    else:
        config = TransformerConfig(**kw, kv_channels=16,
                                   moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                                   moe_router_enable_expert_bias=True, moe_router_dtype="fp32")
    spec = with_mla_core_attention(get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                              normalization=args.normalization))
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=256, max_sequence_length=SEQ,
                    position_embedding_type="rope",
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


def _save_source(case, fmt, root, tokens):
    """(rank 0 of a world of 1) Build, save as Megatron-LM does, and return the direct forward's logits, every MoE
    layer's input (float64), expert weights and tokens routed per expert."""
    from megatron.core import dist_checkpointing

    from mindspeed_proxy import parallel

    args = megatron_lm_args(case)
    args.ckpt_format = fmt
    state = parallel.setup(seed=11)
    model = _build_direct(args)
    gen = torch.Generator().manual_seed(5)
    for layer in model.decoder.layers:
        bias = getattr(getattr(layer.mlp, "router", None), "expert_bias", None)
        if bias is not None:
            bias.copy_(0.05 * torch.randn(bias.shape, generator=gen))
    folder = os.path.join(root, "iter_0000001")
    common = {"args": args, "checkpoint_version": 3.0, "iteration": 1}
    if fmt == "torch_dist":
        os.makedirs(folder)
        dist_checkpointing.save({**common, "model": model.sharded_state_dict()}, folder)
    else:
        os.makedirs(os.path.join(folder, "mp_rank_00"))
        torch.save({**common, "model": model.state_dict_for_save_checkpoint()},
                   os.path.join(folder, "mp_rank_00", "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("1")
    model.eval()
    inputs, usage, experts = {}, {}, {}
    for layer in model.decoder.layers:
        if not hasattr(layer.mlp, "router"):
            continue
        g = layer.layer_number - 1
        layer.mlp.register_forward_pre_hook(
            lambda m, a, g=g: inputs.setdefault(g, []).append(a[0].reshape(-1, H).double().clone()))
        layer.mlp.router.register_forward_hook(
            lambda m, a, out, g=g: usage.setdefault(g, []).append(out[1].reshape(-1, E).sum(0)))
        experts[g] = [(e.linear_fc1.weight.detach().double().clone(), e.linear_fc2.weight.detach().double().clone())
                      for e in layer.mlp.experts.local_experts]
    with torch.no_grad():
        logits = torch.cat([model(tokens[i:i + 4], torch.arange(SEQ).expand(len(tokens[i:i + 4]), SEQ), None)
                            for i in range(0, len(tokens), 4)])
    state.teardown()
    return {"logits": logits, "inputs": {g: torch.cat(x) for g, x in inputs.items()}, "experts": experts,
            "usage": {g: torch.stack(u).sum(0).tolist() for g, u in usage.items()}}


def _calibration_logits(root, tokens):
    """The converter's own model of the checkpoint (its builder and loader), logits on `tokens`."""
    from mindspeed_proxy import parallel
    from mindspeed_proxy.proxy.calibrate import model as calibration_model

    ckpt = open_checkpoint(root, None)
    state = parallel.setup(seed=0)
    model, gpt = calibration_model.build(ckpt.args, ckpt.format)
    outputs._load(gpt, ckpt)
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(tokens[i:i + 4], torch.arange(SEQ).expand(len(tokens[i:i + 4]), SEQ), None)
                            for i in range(0, len(tokens), 4)])
    state.teardown()
    return logits


@pytest.fixture(scope="module", params=[(c, f) for c in CASES for f in ("torch_dist", "torch")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def source(request, tmp_path_factory):
    case, fmt = request.param
    root = tmp_path_factory.mktemp(f"{case}-{fmt}")
    tokens = torch.from_numpy(np.random.default_rng(3).integers(0, 256, size=(8, SEQ)))
    direct = run_distributed(_save_source, 1, case, fmt, str(root / "src"), tokens, timeout=300)[0]
    np.save(root / "calib.npy", tokens.numpy())
    return {"case": case, "fmt": fmt, "root": root, "src": str(root / "src"), "tokens": tokens, "direct": direct}


def test_calibration_model_equals_the_direct_model(source):
    logits = run_distributed(_calibration_logits, 1, source["src"], source["tokens"], timeout=300)[0]
    direct = source["direct"]["logits"]
    assert logits.shape == direct.shape == (8, SEQ, 256)
    # same weights, same megatron-core modules, same eager kernels: equal to fp32 rounding (observed: 0.0)
    assert (logits - direct).abs().max() <= 1e-6 * direct.abs().max()


def test_outputs_features_equal_direct_forward_float64(source):
    ckpt = open_checkpoint(source["src"], None)
    try:
        vectors, usage, count = outputs.output_features(ckpt, source["tokens"])
    finally:
        if hasattr(ckpt, "close"):
            ckpt.close()
    direct = source["direct"]
    assert count == source["tokens"].numel()
    assert sorted(vectors) == sorted(direct["inputs"]) == ([1, 2] if source["case"] == "dense_first" else [0, 1])
    for g, x in direct["inputs"].items():
        rows = []
        for w1, w2 in direct["experts"][g]:  # SwiGLU expert by hand in float64
            gate, up = (x @ w1.T).chunk(2, dim=-1)
            rows.append(((torch.nn.functional.silu(gate) * up) @ w2.T).mean(dim=0))
        ref = torch.stack(rows).numpy()
        # fp32 forward vs float64 by hand; observed ~1e-7 relative
        assert np.abs(vectors[g] - ref).max() <= 1e-5 * np.abs(ref).max(), g
        assert usage[g] == direct["usage"][g] and sum(usage[g]) == TOPK * count, g


@pytest.mark.parametrize("selection", ["cluster", "reconstruction"])
def test_cli_converts_with_the_calibration_forward(source, selection, capsys):
    out = str(source["root"] / f"proxy-{selection}")
    code = main(["--load", source["src"], "--save", out, "--target-expert-parallel-size", "1",
                 "--target-num-experts", "4", "--features", "outputs", "--selection", selection,
                 "--calibration-data", str(source["root"] / "calib.npy")])
    assert code == 0, capsys.readouterr().err
    manifest = json.load(open(os.path.join(out, "proxy_manifest.json")))
    assert manifest["feature_type"] == "outputs" and manifest["selection"] == selection
    moe = [1, 2] if source["case"] == "dense_first" else [0, 1]
    assert [layer["layer"] for layer in manifest["layers"]] == moe
    for layer in manifest["layers"]:
        assert len(layer["kept_global_ids_in_new_order"]) == 4
        assert sum(layer["calibration_usage"]) == TOPK * source["tokens"].numel()
        assert ("reconstruction" in layer) == (selection == "reconstruction")
    # the writer's verification: every kept expert of every MoE layer (legacy: per expert; torch_dist: per tensor,
    # fc1 and fc2) and the kept router rows (weight, and expert_bias where the router has one) compared with the source
    verified = manifest["verification"]
    assert verified["experts"] == 4 * len(moe) * (2 if source["fmt"] == "torch_dist" else 1), verified
    assert verified["router_rows"] == 4 * len(moe) * (2 if source["case"] == "dense_first" else 1), verified


def test_unbuildable_option_refused_in_one_line(tmp_path, capsys):
    from mindspeed_proxy.proxy.calibrate import model as calibration_model
    from mindspeed_proxy.proxy.core.errors import ConversionError

    args = megatron_lm_args("dense_first")
    args.moe_grouped_gemm, args.bf16 = True, True
    calibration_model.model_config(args, "torch_dist")  # local impl: the legacy GroupedMLP it trained builds here
    args.transformer_impl = "transformer_engine"  # trained with TEGroupedMLP, which needs Transformer Engine
    with pytest.raises(ConversionError, match=r"moe_grouped_gemm=True") as info:
        calibration_model.model_config(args, "torch_dist")
    assert "\n" not in str(info.value)
    args = megatron_lm_args("dense_first")
    args.transformer_impl = "transformer_engine"
    calibration_model.model_config(args, "torch_dist")  # torch_dist: local layers load TE's keys (keys map)
    with pytest.raises(ConversionError, match=r"transformer_impl='transformer_engine'"):
        calibration_model.model_config(args, "torch")


TRAINER_MODELS = {"gqa": [], "bias_shared": ["--moe-shared-expert-intermediate-size", "32",
                                             "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"],
                  "mla": ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "24", "--qk-layernorm"],
                  "bf16_dense_second": ["--bf16", "--moe-layer-freq", "2", "--qk-layernorm"]}


def _trainer_model_vs_builder(flags):
    """Logits of the trainer's model (tiny_moe) and of the converter's builder from the args the trainer records,
    both holding the trainer model's weights."""
    from mindspeed_proxy import parallel
    from mindspeed_proxy.proxy.calibrate import model as calibration_model
    from mindspeed_proxy.tiny_moe import build_model
    from mindspeed_proxy.training import arguments as A

    args = A.build_parser().parse_args(["--num-layers", "2"] + flags)
    A.validate_static(args)
    A.validate_world(args, 1)
    state = parallel.setup(seed=4)
    trainer_model = build_model(A.model_config(args)).eval()
    model, gpt = calibration_model.build(args, "torch_dist")
    gpt.load_state_dict(getattr(trainer_model, "module", trainer_model).state_dict(), strict=True)
    model.eval()
    tokens = torch.from_numpy(np.random.default_rng(1).integers(0, 256, size=(2, 64)))
    positions = torch.arange(64).expand_as(tokens)
    with torch.no_grad():
        out = trainer_model(tokens, positions, None).float(), model(tokens, positions, None).float()
    state.teardown()
    return out


@pytest.mark.parametrize("name", sorted(TRAINER_MODELS))
def test_trainer_checkpoints_build_through_the_spec_builder(name):
    """Our trainer's args (what validate_world records) rebuild the model it trains, bit for bit."""
    trained, rebuilt = run_distributed(_trainer_model_vs_builder, 1, TRAINER_MODELS[name], timeout=300)[0]
    assert trained.shape == (2, 64, 264) and torch.equal(trained, rebuilt)
