"""`mindspeed-proxy plan`: parameter counts of four public MoE configs against hand arithmetic and the published
totals, the converter's EP rules, memory per rank, FLOPs, the Megatron sources (real checkpoints, flags), bad input."""
import os

import pytest
import torch

from mindspeed_proxy.cli import main as cli_main
from mindspeed_proxy.proxy import model_spec
from mindspeed_proxy.proxy import planner

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_configs")


def spec(name):
    return model_spec.read_hf_config(os.path.join(FIXTURES, name + ".json"))


def _hand_deepseek_v3():
    h, v = 7168, 129280
    attn = (h * 1536 + 1536 + 1536 * 128 * (128 + 64)  # q down, its norm, q up
            + h * (512 + 64) + 512 + 512 * 128 * (128 + 128)  # kv down (+ shared RoPE key), its norm, kv up
            + 128 * 128 * h)  # output projection
    norms = 2 * h
    expert = 3 * h * 2048
    dense_layer = attn + norms + 3 * h * 18432
    moe_fixed = attn + norms + 256 * h + 256 + expert  # router rows, e_score_correction_bias, 1 shared expert
    total = 3 * dense_layer + 58 * (moe_fixed + 256 * expert) + 2 * v * h + h
    active = 3 * dense_layer + 58 * (moe_fixed + 8 * expert) + 2 * v * h + h
    return total, active


def _hand_gqa(layers, h, heads, kv, hd, vocab, experts, topk, ffn, qk_norm):
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + (2 * hd if qk_norm else 0)
    fixed = attn + 2 * h + experts * h
    expert = 3 * h * ffn
    emb = 2 * vocab * h + h
    return layers * (fixed + experts * expert) + emb, layers * (fixed + topk * expert) + emb


# (fixture, hand (total, active), published total, published active, relative tolerance of the published active)
MODELS = {
    # DeepSeek-V3 report: 671B total, 37B activated (a rounded figure: 37.55B here counts both embedding tables)
    "deepseek_v3": (_hand_deepseek_v3(), 671e9, 37e9, 0.02),
    # Qwen3 report / model card: 30.5B total, 3.3B activated (3.35B here)
    "qwen3_30b_a3b": (_hand_gqa(48, 2048, 32, 4, 128, 151936, 128, 8, 768, True), 30.5e9, 3.3e9, 0.02),
    "qwen3_235b_a22b": (_hand_gqa(94, 4096, 64, 4, 128, 151936, 128, 8, 1536, True), 235e9, 22e9, 0.01),
    # Mixtral of Experts paper: 46.7B total, 12.9B active
    "mixtral_8x7b": (_hand_gqa(32, 4096, 32, 8, 128, 32000, 8, 2, 14336, False), 46.7e9, 12.9e9, 0.01),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_parameter_counts_match_hand_arithmetic_and_published_totals(name):
    (total, active), published, published_active, tol = MODELS[name]
    counted = planner.count(spec(name))
    assert (counted["total"], counted["active"]) == (total, active)
    assert abs(counted["total"] - published) / published < 0.01
    assert abs(counted["active"] - published_active) / published_active < tol


def test_proxy_counts_drop_only_the_pruned_experts_and_router_rows():
    s = spec("deepseek_v3")
    full, proxy = planner.count(s), planner.count(s, 32)
    per_layer = 224 * (3 * 7168 * 2048 + 7168 + 1)  # 224 experts, their router rows and bias entries
    assert full["total"] - proxy["total"] == 58 * per_layer
    assert full["active"] - proxy["active"] == 58 * 224 * (7168 + 1)  # top-8 unchanged: same experts per token
    gap = planner.flops_per_token(s, 256, 4096) - planner.flops_per_token(s, 32, 4096)
    assert gap == 6 * 58 * 224 * 7168  # router matmul rows (the bias is no matmul)


def test_mtp_module_counted_apart_as_the_published_totals():
    """DeepSeek-V3's MTP layer (Megatron: enorm, hnorm, eh_proj [h, 2h], a MoE transformer layer, final norm; embedding
    and output layer shared) is out of the 671B and reported apart, its routed experts pruned to K like the decoder's."""
    s = spec("deepseek_v3")
    assert s.mtp_layers == 1
    h = 7168
    attn = (h * 1536 + 1536 + 1536 * 128 * 192 + h * 576 + 512 + 512 * 128 * 256 + 128 * 128 * h)
    expert = 3 * h * 2048
    for k in (256, 32):
        layer = attn + 2 * h + k * h + k + expert + k * expert  # norms, router rows + bias, shared, routed experts
        assert planner.mtp_count(s, k) == {"total": layer + 3 * h + 2 * h * h, "experts": k * expert}
    assert planner.count(s)["total"] == _hand_deepseek_v3()[0]  # unchanged by the MTP layer
    layout = _layout("deepseek_v3", 1, 16, 64, 64)
    result = planner.plan(s, layout, planner.Run(seq_length=4096, micro_batch=1, global_batch=1024, memory_gib=80),
                          eps=[8], ks=[32])
    assert result["original"]["mtp"] == planner.mtp_count(s) and result["proxies"][0]["mtp"]["experts"] == 32 * expert


def _layout(name, tp, pp, ep, dp):
    return planner.source_layout(spec(name), tp, pp, ep, dp)


def test_ep_rules_are_the_converters():
    s = spec("deepseek_v3")  # 8 groups, top-4 groups, top-8, a group scored by its top-2 experts
    options = planner.proxy_options(s, _layout("deepseek_v3", 1, 16, 64, 64), eps=[8, 2, 1])
    by = {(ep, k): problems for ep, k, problems in options}
    assert by[(8, 32)] == []                      # keeps 4 experts per rank
    assert any("moe_router_topk = 8" in p for p in by[(2, 8)])  # 8 / 8 groups x 4 groups < top-8
    assert (2, 16) in by and by[(2, 16)] == []    # the smallest valid K above the refused one
    assert any("divisible by moe_router_num_groups" in p for p in by[(1, 4)])
    assert planner.proxy_options(s, _layout("deepseek_v3", 1, 16, 64, 64), eps=[8], ks=[12])[0][2]  # 12 % 8
    mixtral = planner.proxy_options(spec("mixtral_8x7b"), _layout("mixtral_8x7b", 1, 1, 8, 8))
    assert [(ep, k, bool(p)) for ep, k, p in mixtral] == [(4, 4, False), (2, 2, False), (1, 1, True), (1, 2, False)]
    at_ep1 = planner.proxy_options(spec("mixtral_8x7b"), _layout("mixtral_8x7b", 1, 1, 1, 8), ks=[4])
    assert at_ep1 == [(1, 4, [])]  # EP 1: K given, planned at EP 1 (the expert-DP replicas dropped: 8 -> 1 rank)
    assert planner.proxy_options(spec("mixtral_8x7b"), _layout("mixtral_8x7b", 1, 1, 1, 8)) == []


def test_memory_per_rank_by_hand_mixtral():
    s = spec("mixtral_8x7b")
    run = planner.Run(seq_length=4096, micro_batch=1, global_batch=64, memory_gib=80, distributed_optimizer=True)
    m = planner.stage_memory(s, planner.source_layout(s, 2, 4, 8, 8), run, 0)  # TP2 PP4 EP8 DP8: 64 ranks
    h, v = 4096, 32000
    dense = (8 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 2 * h + 8 * h) + v * h) // 2  # 8 layers + embedding, / TP
    expert = 8 * 3 * h * 14336 // 2  # 1 expert per EP rank per layer, / expert TP = TP
    assert m["weights"] == 2 * (dense + expert) and m["grads"] == 4 * (dense + expert)
    assert m["optimizer"] == 12 * (dense / 8 + expert / 1)  # expert DP = TP x DP / (EP x expert TP) = 1
    per_layer = 2 * h + 2 * 4096 + 2 * 1024 + 2 * h + 4 * 8 + 2 * (2 * h + 3 * 14336)
    assert m["activations"] == 4 * 8 * 2 * per_layer * 4096 / 2  # 4 micro-batches in flight on stage 0


def test_proxy_keeping_experts_per_rank_keeps_weights_per_rank_and_cuts_ranks():
    s = spec("qwen3_235b_a22b")
    run = planner.Run(seq_length=4096, micro_batch=1, global_batch=256, memory_gib=64, distributed_optimizer=True,
                      recompute=True)
    result = planner.plan(s, planner.source_layout(s, 4, 8, 16, 16), run)
    original, proxies = result["original"], result["proxies"]
    assert [(r["K"], r["ep"], r["ranks"]) for r in proxies] == [(64, 8, 256), (32, 4, 128), (16, 2, 64), (8, 1, 32)]
    stage0 = planner.stage_memory(s, planner.source_layout(s, 4, 8, 16, 16), run, 0)["weights"]
    for r in proxies:  # same experts per rank: stage 0's 12 layers differ by their router rows only
        proxy_layout = planner.target_layout(planner.source_layout(s, 4, 8, 16, 16), r["ep"], r["K"])
        assert stage0 - planner.stage_memory(s, proxy_layout, run, 0)["weights"] == 2 * 12 * (128 - r["K"]) * 4096 // 4
        assert r["fewer_accelerators"] == 1 - r["ranks"] / 512
        assert r["cost_ratio"] > 1  # same work per step, smaller bubble, less all-to-all across nodes
    assert original["fits"] and not planner.evaluate(
        s, planner.source_layout(s, 1, 1, 16, 16), run)["fits"]  # 235B at TP1 PP1 cannot fit 64 GiB


def test_megatron_flags_give_the_same_model_as_the_hf_config(tmp_path):
    flags = ("--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 "
             "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 "
             "--qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm --num-experts 256 --moe-ffn-hidden-size 2048 "
             "--moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-router-num-groups 8 "
             "--moe-router-group-topk 4 --moe-router-enable-expert-bias --moe-layer-freq '([0]*3+[1]*58)' --swiglu "
             "--untie-embeddings-and-output-weights --normalization RMSNorm --disable-bias-linear "
             "--vocab-size 129280 --lr 1e-4 --tokenizer-type HuggingFaceTokenizer")  # the last two: ignored
    path = tmp_path / "flags.sh"
    path.write_text("GPT_ARGS=\\\n" + flags.replace(" --", " \\\n  --") + "\n")
    args = planner_args(["--megatron-args-file", str(path), "--expert-model-parallel-size", "8"])
    from mindspeed_proxy.proxy.plan_cli import model_and_defaults

    s, _ = model_and_defaults(args)
    assert planner.count(s) == planner.count(spec("deepseek_v3"))
    assert planner.flops_per_token(s, 256, 4096) == planner.flops_per_token(spec("deepseek_v3"), 256, 4096)
    path.write_text(flags.replace("--qk-layernorm ", ""))  # Megatron's MLA has latent norms only with it
    plain = model_and_defaults(planner_args(["--megatron-args-file", str(path)]))[0]
    assert planner.count(s)["total"] - planner.count(plain)["total"] == 61 * (1536 + 512)
    padded = model_and_defaults(planner_args(["--megatron-args-file", str(path), "--vocab-size", "129281",
                                              "--tensor-model-parallel-size", "2"]))[0]
    assert padded.vocab == 129280 + 256  # Megatron pads to a multiple of 128 x TP


def planner_args(argv):
    from mindspeed_proxy.proxy.plan_cli import build_parser

    return build_parser().parse_args(argv + ["--accelerator-memory-gib", "64", "--seq-length", "4096"])


def _numel_legacy(root, ep):
    from mindspeed_proxy.checkpoint_io import safe_torch_load
    from mindspeed_proxy.proxy.core.tracker import resolve_iteration

    _, folder = resolve_iteration(root, None)
    n = 0
    for e in range(ep):
        model = safe_torch_load(os.path.join(folder, f"mp_rank_00_{e:03d}", "model_optim_rng.pt"))["model"]
        n += sum(t.numel() for k, t in model.items() if isinstance(t, torch.Tensor) and (e == 0 or ".experts." in k))
    return n


def test_counts_equal_the_tensors_of_real_megatron_checkpoints(checkpoints, dist_checkpoints):
    legacy = checkpoints("ep2_bias")  # shared expert + expert bias, EP=2
    s = model_spec.from_megatron_args(model_spec.read_checkpoint_args(legacy), legacy)
    assert planner.count(s)["total"] == _numel_legacy(legacy, 2)
    assert s.layout == {"tp": 1, "pp": 1, "ep": 2, "dp": 2}
    dist = dist_checkpoints("grouped")  # torch_dist, layers 1 and 3 dense (--moe-layer-freq 2)
    s = model_spec.from_megatron_args(model_spec.read_checkpoint_args(dist), dist)
    from mindspeed_proxy.proxy.io.dist.index import DistIndex
    from mindspeed_proxy.proxy.core.tracker import resolve_iteration

    index = DistIndex(resolve_iteration(dist, None)[1])
    numel = sum(torch.Size(shape).numel() for shape, _ in index.tensors.values())
    assert s.moe_layers == (True, False, True, False)
    assert planner.count(s)["total"] == numel


def test_mtp_count_equals_the_mtp_tensors_of_a_real_checkpoint(checkpoints):
    legacy = checkpoints("mtp")  # --mtp-num-layers 1, shared expert + expert bias, EP=2
    s = model_spec.from_megatron_args(model_spec.read_checkpoint_args(legacy), legacy)
    from mindspeed_proxy.checkpoint_io import safe_torch_load
    from mindspeed_proxy.proxy.core.tracker import resolve_iteration

    folder = resolve_iteration(legacy, None)[1]
    models = [safe_torch_load(os.path.join(folder, f"mp_rank_00_{e:03d}", "model_optim_rng.pt"))["model"] for e in (0, 1)]
    mtp = sum(t.numel() for e, m in enumerate(models) for k, t in m.items()
              if isinstance(t, torch.Tensor) and k.startswith("mtp.") and (e == 0 or ".experts." in k))
    experts = sum(t.numel() for m in models for k, t in m.items()
                  if isinstance(t, torch.Tensor) and k.startswith("mtp.") and ".local_experts." in k)
    assert planner.mtp_count(s) == {"total": mtp, "experts": experts} and experts > 0
    assert planner.count(s)["total"] + mtp == _numel_legacy(legacy, 2)


def test_cli_prints_the_table(capsys, checkpoints, tmp_path):
    ckpt = checkpoints("ep2_bias")
    assert cli_main(["plan", "--load", ckpt, "--accelerator-memory-gib", "1"]) == 0
    out = capsys.readouterr().out
    assert "| original | 8 | 2 | 1x1x2 = 2 |" in out and "| proxy | 4 | 1 | 1x1x1 = 1 (50.0% fewer) |" in out
    assert cli_main(["plan", "--hf-config", os.path.join(FIXTURES, "qwen3_30b_a3b.json"),
                     "--expert-model-parallel-size", "8", "--accelerator-memory-gib", "80", "--seq-length", "4096",
                     "--target-expert-parallel-size", "4", "--target-num-experts", "64", "32"]) == 0
    out = capsys.readouterr().out
    assert "| proxy | 64 | 4 |" in out and "| proxy | 32 | 4 |" in out and "30.53B" in out
    hf = tmp_path / "hf"  # a Hugging Face folder given to --load, as the converter takes it
    hf.mkdir()
    (hf / "config.json").write_text(open(os.path.join(FIXTURES, "mixtral_8x7b.json")).read())
    (hf / "model.safetensors").write_bytes(b"")
    assert cli_main(["plan", "--load", str(hf), "--expert-model-parallel-size", "8", "--accelerator-memory-gib", "80",
                     "--seq-length", "4096"]) == 0
    assert "| original | 8 | 8 | 1x1x8 = 8 | 46.70B | 12.88B |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--hf-config", "/nonexistent/config.json"], "cannot read JSON"),
    (["--hf-config", "mixtral_8x7b.json"], "--expert-model-parallel-size is required"),
    (["--hf-config", "mixtral_8x7b.json", "--expert-model-parallel-size", "3"], "not divisible by EP 3"),
    (["--hf-config", "mixtral_8x7b.json", "--expert-model-parallel-size", "8", "--data-parallel-size", "4"],
     "must divide the data-parallel size 4"),
    (["--hf-config", "deepseek_v3.json", "--expert-model-parallel-size", "64", "--target-expert-parallel-size", "8",
      "--target-num-experts", "4"], "at --target-expert-parallel-size 8: --target-num-experts 4 is invalid: "
     "K must be divisible by EP2 = 8; K must be >= moe_router_topk = 8"),
    (["--num-layers", "4", "--hidden-size", "64"], "no num_attention_heads, num_experts"),
    (["--hf-config", "mixtral_8x7b.json", "--num-layers", "4"], "give one model source"),
    ([], "no model"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    argv = [os.path.join(FIXTURES, a) if a.endswith("7b.json") or a.endswith("v3.json") else a for a in argv]
    assert cli_main(["plan", *argv, "--accelerator-memory-gib", "80", "--seq-length", "4096"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mindspeed-proxy plan: error: ") and message in err


def test_moe_layer_freq_forms():
    assert model_spec.moe_pattern("([0]*1+[1]*2)", 3, "x") == (False, True, True)
    assert model_spec.moe_pattern(2, 4, "x") == (True, False, True, False)
    with pytest.raises(ValueError, match="list expression"):
        model_spec.moe_pattern("[__import__('os')]", 1, "x")
