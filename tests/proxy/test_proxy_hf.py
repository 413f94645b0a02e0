"""Hugging Face MoE checkpoints (`--format hf`, or detected): tiny random models that transformers builds from a
config (no download), saved as several safetensors shards + index, converted to K=4, loaded back with
`AutoModelForCausalLM.from_pretrained`.

Functional identity, per routing rule (what is exactly equivalent):
- softmax then top-k (Qwen2-MoE with norm_topk_prob=False: weights are softmax probabilities over ALL
  experts; Qwen3-MoE with norm_topk_prob=True; Mixtral: top-k renormalised; DeepSeek-V2 group-limited
  greedy: softmax, per-group max, top groups, top-k, no renormalisation): the proxy equals the original
  whose router LOGITS of the dropped experts are -inf before the softmax (the softmax then normalises
  over the kept experts, as the proxy's does). Removing experts only after the softmax would not be
  equivalent without renormalisation, so the mask is applied to the logits, inside transformers' own
  router code.
- DeepSeek-V3 (sigmoid scores, choice on score + e_score_correction_bias, groups scored by their top 2,
  top `topk_group` groups, weights = unbiased scores, normalised, scaled): the proxy equals the original
  whose e_score_correction_bias of the dropped experts is -inf (they leave the group scores and the
  top-k; the selected experts' weights are unchanged), given >= 2 kept experts per group (K/n_group = 2).
Logits agree to <= 1e-5 in fp32; two controls show the comparison is sensitive: the proxy differs from
the unmasked original, and from the original masked to the complementary expert set.
"""
import json
import os
import shutil
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")

from mindspeed_proxy.proxy.cli import main  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
            max_position_embeddings=64)
CONFIGS = {
    # 3 layers, layer 1 dense (mlp_only_layers); shared expert + sigmoid shared_expert_gate
    "qwen2_moe": dict(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                      num_hidden_layers=3, mlp_only_layers=[1], num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=False),
    "qwen3_moe": dict(intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, head_dim=8,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "mixtral": dict(intermediate_size=16, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2),
    "deepseek_v3": dict(intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, num_key_value_heads=4,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                        n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8),
    "deepseek_v2": dict(intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, num_key_value_heads=4,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                        topk_method="group_limited_greedy", n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
}
FLAGS = ["--target-expert-parallel-size", "2", "--target-num-experts", "4"]


def _moe_blocks(model):
    """(layer number, MoE block) of every decoder layer whose MLP has routed experts."""
    return [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def _build(model_type, folder, seed=0):
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **CONFIGS[model_type]})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # well-separated router scores (no near-ties), a bias that changes the choice
        for _, block in _moe_blocks(model):
            block.gate.weight.normal_(0.0, 1.0)
            if hasattr(block.gate, "e_score_correction_bias"):
                block.gate.e_score_correction_bias.normal_(0.0, 0.2)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="20KB")
    return model


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{model_type: (folder, original model)} built once."""
    root = tmp_path_factory.mktemp("hf-sources")
    return {name: (str(root / name), _build(name, str(root / name))) for name in CONFIGS}


def _tokens():
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits.float()


def _masked_logits(monkeypatch, model, kept, tokens):
    """Logits of `model` with every MoE layer's router restricted to `kept[layer]` (see the module docstring)."""
    modeling = sys.modules[type(model).__module__]
    masks, calls, biases = {}, {}, []
    for i, block in _moe_blocks(model):
        dropped = torch.ones(block.gate.weight.shape[0], dtype=torch.bool)
        dropped[kept[i]] = False
        if hasattr(block.gate, "e_score_correction_bias"):
            biases.append((block.gate.e_score_correction_bias, block.gate.e_score_correction_bias.clone()))
            block.gate.e_score_correction_bias[dropped] = float("-inf")
        else:
            masks[block.gate.weight.data_ptr()] = torch.zeros(dropped.shape).masked_fill(dropped, float("-inf"))

    class MaskedFunctional:  # torch.nn.functional as the modeling module sees it, router logits masked
        def __getattr__(self, name):
            return getattr(torch.nn.functional, name)

        @staticmethod
        def linear(x, weight, bias=None):
            out = torch.nn.functional.linear(x, weight, bias)
            mask = masks.get(weight.data_ptr())
            if mask is not None:
                calls[weight.data_ptr()] = calls.get(weight.data_ptr(), 0) + 1
                out = out + mask
            return out

    try:
        with monkeypatch.context() as m:
            m.setattr(modeling, "F", MaskedFunctional())
            logits = _logits(model, tokens)
    finally:
        with torch.no_grad():
            for param, value in biases:
                param.copy_(value)
    assert set(calls) == set(masks)  # every masked router was really called through the mask
    return logits


def _kept(out):
    manifest = json.load(open(os.path.join(out, "proxy_manifest.json")))
    assert manifest["format"] == "hf" and manifest["num_experts"] == {"source": 8, "proxy": 4}
    return {entry["layer"]: entry["kept_global_ids_in_new_order"] for entry in manifest["layers"]}, manifest


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_hf_proxy_equals_masked_original(sources, tmp_path, monkeypatch, hash_folder, capsys, model_type):
    src, original = sources[model_type]
    assert len([n for n in os.listdir(src) if n.endswith(".safetensors")]) >= 9  # several shards + index
    assert os.path.isfile(os.path.join(src, "model.safetensors.index.json"))
    before = hash_folder(src)
    out = str(tmp_path / "proxy")
    fmt = ["--format", "hf"] if model_type == "mixtral" else []  # the others are detected
    assert main(["--load", src, "--save", out, *FLAGS, *fmt]) == 0
    assert "load with: AutoModelForCausalLM.from_pretrained" in capsys.readouterr().out
    assert hash_folder(src) == before
    kept, manifest = _kept(out)
    moe_layers = [i for i, _ in _moe_blocks(original)]
    assert sorted(kept) == moe_layers and all(len(k) == 4 and k == sorted(k) for k in kept.values())
    if model_type.startswith("deepseek"):  # group-limited: 2 of each group of 4
        assert all(sum(g < 4 for g in k) == 2 for k in kept.values())
    config = json.load(open(os.path.join(out, "config.json")))
    source_config = json.load(open(os.path.join(src, "config.json")))
    changed = {k for k in config if config[k] != source_config.get(k)}
    assert changed == set(manifest["args_diff"]) and len(changed) == 1 and config[changed.pop()] == 4
    assert set(config) == set(source_config)
    assert manifest["verification"]["experts"] == 4 * len(moe_layers)

    proxy, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    proxy.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    for i, block in _moe_blocks(proxy):
        gate = dict(_moe_blocks(original))[i].gate
        assert torch.equal(block.gate.weight, gate.weight[kept[i]])
        if hasattr(gate, "e_score_correction_bias"):
            assert torch.equal(block.gate.e_score_correction_bias, gate.e_score_correction_bias[kept[i]])
    tokens = _tokens()
    got = _logits(proxy, tokens)
    want = _masked_logits(monkeypatch, original, kept, tokens)
    assert (got - want).abs().max().item() <= 1e-5
    assert (got - _logits(original, tokens)).abs().max().item() > 1e-3  # pruning changed the function
    complement = {i: sorted(set(range(8)) - set(k)) for i, k in kept.items()}
    assert (got - _masked_logits(monkeypatch, original, complement, tokens)).abs().max().item() > 1e-3


def test_hf_fused_single_file_round_trip(sources, tmp_path, monkeypatch):
    """Experts stored fused (`experts.gate_up_proj` [E, 2F, H], transformers' in-memory layout) in one
    model.safetensors without an index: the proxy keeps that layout and is the masked original."""
    from safetensors.torch import save_file

    src, original = sources["qwen3_moe"]
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(os.path.join(src, "config.json"), fused)
    save_file({k: v.contiguous() for k, v in original.state_dict().items()}, str(fused / "model.safetensors"),
              metadata={"format": "pt"})
    out = str(tmp_path / "proxy")
    assert main(["--load", str(fused), "--save", out, *FLAGS]) == 0
    kept, manifest = _kept(out)
    assert manifest["hf"]["expert_layout"] == ["fused"] and not manifest["hf"]["sharded"]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "proxy_manifest.json"]
    proxy, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tokens = _tokens()
    assert (_logits(proxy.eval(), tokens) - _masked_logits(monkeypatch, original, kept, tokens)).abs().max() <= 1e-5


def test_hf_bf16_experts_bit_exact(tmp_path):
    """A bf16 Mixtral (2-byte dtype through the streaming writer), one tensor per shard: shards left empty by
    the dropped experts are not written and the rest renumbered; the loaded proxy's experts and router rows
    are the source's kept experts, bit for bit."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    saved, src = tmp_path / "saved", tmp_path / "src"
    original = _build("mixtral", str(tmp_path / "fp32"), seed=3).to(torch.bfloat16)
    original.save_pretrained(saved, safe_serialization=True, max_shard_size="1KB")
    src.mkdir()
    shutil.copy(saved / "config.json", src)
    weight_map = {}  # re-shard: one tensor per file (save_pretrained groups all experts of a layer's projection)
    for i, (key, shard) in enumerate(sorted(_index(saved)["weight_map"].items())):
        with safe_open(str(saved / shard), framework="pt") as fh:
            name = f"model-{i + 1:05d}-of-{len(_index(saved)['weight_map']):05d}.safetensors"
            save_file({key: fh.get_tensor(key)}, str(src / name), metadata={"format": "pt"})
        weight_map[key] = name
    json.dump({"metadata": {}, "weight_map": weight_map}, open(src / "model.safetensors.index.json", "w"))
    src, out = str(src), str(tmp_path / "proxy")
    assert main(["--load", src, "--save", out, *FLAGS]) == 0
    kept, _ = _kept(out)
    shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    n = len(shards)
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    source_shards = len(set(_index(src)["weight_map"].values()))
    assert n == source_shards - 2 * 4 * 3 and set(_index(out)["weight_map"].values()) == set(shards)
    proxy = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for (i, block), (_, want) in zip(_moe_blocks(proxy), _moe_blocks(original)):
        assert block.experts.gate_up_proj.dtype == torch.bfloat16
        assert torch.equal(block.gate.weight, want.gate.weight[kept[i]])
        assert torch.equal(block.experts.gate_up_proj, want.experts.gate_up_proj[kept[i]])
        assert torch.equal(block.experts.down_proj, want.experts.down_proj[kept[i]])


def test_hf_dry_run_writes_nothing(sources, tmp_path, capsys):
    src, _ = sources["deepseek_v3"]
    assert main(["--load", src, "--save", str(tmp_path / "out"), *FLAGS, "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "Hugging Face checkpoint" in text and "config.json changed: {'n_routed_experts': [8, 4]}" in text
    assert "layer 0:" not in text and "layer 1: keep [" in text and "layer 2: keep [" in text  # layer 0 dense
    assert list(tmp_path.iterdir()) == []


def _index(root):
    return json.load(open(os.path.join(root, "model.safetensors.index.json")))


def _edit_json(path, fn):
    value = json.load(open(path))
    fn(value)
    json.dump(value, open(path, "w"))


def _break(case, root, work):
    """Damage the copy at `root` for `case`; return (load, extra flags, expected message fragment)."""
    index = _index(root)
    if case == "missing-shard":
        shard = index["weight_map"]["model.layers.0.mlp.experts.3.up_proj.weight"]
        os.remove(os.path.join(root, shard))
        return root, [], f"missing shard {shard} named in model.safetensors.index.json"
    if case == "config-without-experts":
        _edit_json(os.path.join(root, "config.json"), lambda c: c.pop("num_experts"))
        return root, [], "not an MoE checkpoint"
    if case == "k-invalid":
        return root, ["--target-num-experts", "3"], "nearest valid K: 2, 4"
    if case == "k-above-e":
        return root, ["--target-num-experts", "16"], "K must lie in [1, 8]"
    if case == "truncated-shard":
        path = os.path.join(root, index["weight_map"]["model.layers.0.mlp.gate.weight"])
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
        return root, [], "truncated or unreadable shard"
    if case == "index-names-wrong-shard":
        key = "model.layers.2.mlp.gate.weight"
        other = next(s for s in sorted(set(index["weight_map"].values())) if s != index["weight_map"][key])
        _edit_json(os.path.join(root, "model.safetensors.index.json"), lambda i: i["weight_map"].update({key: other}))
        return root, [], "which does not hold it"
    if case == "expert-missing-from-index":
        _edit_json(os.path.join(root, "model.safetensors.index.json"), lambda i: [
            i["weight_map"].pop(k) for k in list(i["weight_map"]) if ".layers.2.mlp.experts.7." in k])
        return root, [], "missing [7]"
    if case == "unsupported-model-type":
        _edit_json(os.path.join(root, "config.json"), lambda c: c.update(model_type="olmoe"))
        return root, [], "model_type 'olmoe' is not supported"
    if case == "features-outputs":
        return root, ["--features", "outputs"], "not supported for Hugging Face checkpoints"
    if case == "hf-format-without-config":
        os.makedirs(work / "junk")
        (work / "junk" / "model.safetensors").write_bytes(b"")
        return str(work / "junk"), ["--format", "hf"], "no config.json (not a Hugging Face checkpoint)"
    raise AssertionError(case)


CASES = ["missing-shard", "config-without-experts", "k-invalid", "k-above-e", "truncated-shard",
         "index-names-wrong-shard", "expert-missing-from-index", "unsupported-model-type", "features-outputs",
         "hf-format-without-config"]


@pytest.mark.parametrize("case", CASES)
def test_hf_bad_input(sources, tmp_path, capsys, hash_folder, case):
    root = str(tmp_path / "ckpt")
    shutil.copytree(sources["qwen2_moe"][0], root)
    load, extra, fragment = _break(case, root, tmp_path)
    save = str(tmp_path / "out")
    flags = FLAGS[:2] + extra if "--target-num-experts" in extra else FLAGS + extra
    before = hash_folder(load)
    listing = sorted(os.listdir(tmp_path))
    rc = main(["--load", load, "--save", save, *flags])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("convert_to_proxy.py: error: "), err
    assert fragment in err[0], err[0]
    assert not os.path.exists(save)
    assert sorted(os.listdir(tmp_path)) == listing  # no temporary folder left beside OUT_DIR
    assert hash_folder(load) == before


def test_hf_deepseek_v3_needs_two_experts_per_group(sources, tmp_path, capsys):
    """HF DeepSeek-V3 scores each group by its top 2 experts: K / n_group must be >= 2 (K=2, n_group=2 refused
    even with topk_group=2, which Megatron's rules alone would accept)."""
    root = str(tmp_path / "ckpt")
    shutil.copytree(sources["deepseek_v3"][0], root)
    _edit_json(os.path.join(root, "config.json"), lambda c: c.update(topk_group=2))
    rc = main(["--load", root, "--save", str(tmp_path / "out"), "--target-expert-parallel-size", "1",
               "--target-num-experts", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "K / moe_router_num_groups = 1 must be >= 2" in err[0], err
    assert "nearest valid K: 4" in err[0] and not os.path.exists(tmp_path / "out")
