"""Layouts beyond TP x EP: PP=2 with virtual stages (legacy and torch_dist), torch_dist per-layer expert keys,
TEGroupedMLP's expert naming. Real checkpoints from the real trainer, proxies loaded back by megatron-core."""
import json
import os
import re
import shutil

import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.proxy.cli import main
from mindspeed_proxy.testing import run_distributed
from mindspeed_proxy.proxy.printed_launch import read_launch

from helpers import dist_common, forward, load_model, mask_router  # noqa: E402  (tests/proxy is on sys.path)
from test_proxy_dist import _convert as convert_subprocess, read_all  # noqa: E402
from test_proxy_dist import identity_check as dist_identity_check  # noqa: E402
from test_proxy_legacy import identity_check as legacy_identity_check  # noqa: E402

FILE, ITER2 = "model_optim_rng.pt", "iter_0000002"


def _convert(src, out, ep_dst=1, k=4, seed=3):
    assert main(["--load", src, "--save", out, "--target-expert-parallel-size", str(ep_dst), "--target-num-experts",
                 str(k), "--selection", "random", "--seed", str(seed)]) == 0
    return _kept(out)


def _kept(out):
    manifest = json.load(open(os.path.join(out, "proxy_manifest.json")))
    return {e["layer"]: e["kept_global_ids_in_new_order"] for e in manifest["layers"]}, manifest


def _state(root, name):
    return safe_torch_load(os.path.join(root, ITER2, name, FILE))


def pipeline_identity(src, out, args, k, kept, fmt):
    """Original (PP=2, 2 virtual stages, EP=2) vs proxy (same PP/VPP, EP=1): logits on the last stage, masked
    original vs proxy; torch_dist also reloads both at PP=1 (resharded) and compares with the pipelined run."""
    from megatron.core import parallel_state as ps

    from mindspeed_proxy.testing.batches import synthetic_microbatches
    from mindspeed_proxy.training.arguments import model_config

    cfg = model_config(args)
    batch = synthetic_microbatches([[0, 1]], cfg.seq_length, cfg.vocab_size)[0]
    original = load_model(src, cfg, tp=1, ep=2, fmt=fmt, pp=2)
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    chunk_layers = [[layer.layer_number - 1 for layer in c.decoder.layers] for c in original]
    plain = forward(original, batch)
    mask_router(original, kept)
    masked = forward(original, batch)
    got = forward(load_model(out, cfg.replace(num_experts=k), tp=1, ep=1, fmt=fmt, pp=2), batch)
    result = {"last": last, "chunk_layers": chunk_layers, "pp_rank": ps.get_pipeline_model_parallel_rank()}
    if last:
        result.update(masked=(got - masked).abs().max().item(), unmasked=(got - plain).abs().max().item(),
                      scale=masked.abs().max().item())
    if fmt == "torch_dist":  # the same checkpoints resharded onto PP=1 (no virtual stages)
        flat = cfg.replace(extra={})
        original = load_model(src, flat, tp=1, ep=2, fmt=fmt)
        flat_plain = forward(original, batch)
        mask_router(original, kept)
        flat_masked = forward(original, batch)
        flat_got = forward(load_model(out, flat.replace(num_experts=k), tp=1, ep=1, fmt=fmt), batch)
        result.update(flat_masked=(flat_got - flat_masked).abs().max().item())
        if last:
            result.update(pp_vs_flat=(flat_plain - plain).abs().max().item())
    return result


def _check_pipeline_results(results):
    assert sorted(r["pp_rank"] for r in results) == [0, 0, 1, 1]
    for r in results:  # virtual stages: chunk v of stage p holds global layer v*2 + p
        assert r["chunk_layers"] == [[r["pp_rank"]], [2 + r["pp_rank"]]], r
        if r["last"]:
            assert r["masked"] <= 1e-6 * max(1.0, r["scale"]), r  # observed: exactly 0.0
            assert r["unmasked"] > 1e-3, r


def test_legacy_pp2_vpp2_proxy_bit_exact_and_matches_masked_original(checkpoints, tmp_path):
    src = checkpoints("pp2_vpp")
    out = str(tmp_path / "proxy")
    kept, manifest = _convert(src, out)
    assert sorted(kept) == [0, 1, 2, 3] and any(max(v) >= 4 for v in kept.values())
    for entry in manifest["layers"]:  # global layer = chunk * (PP x layers per chunk) + stage
        assert entry["layer"] == int(entry["chunk"][-1]) * 2 + entry["pipeline_stage"], entry
    assert sorted(os.listdir(os.path.join(out, ITER2))) == ["mp_rank_00_000", "mp_rank_00_001"]
    checked = {"experts": 0, "router": 0, "other": 0}
    for pp in range(2):
        proxy = _state(out, f"mp_rank_00_{pp:03d}")
        sources = [_state(src, f"mp_rank_00_{pp:03d}_{ep:03d}") for ep in range(2)]
        assert [k for k in proxy if k.startswith("model")] == ["model0", "model1"]
        for v, chunk in enumerate(("model0", "model1")):
            layer = v * 2 + pp  # the chunk's only layer, stored as decoder.layers.0
            for key, value in proxy[chunk].items():
                match = re.search(r"local_experts\.(\d+)\.", key)
                if match:
                    g = kept[layer][int(match.group(1))]
                    want = sources[g // 4][chunk][key.replace(match.group(0), f"local_experts.{g % 4}.")]
                    assert torch.equal(value, want) if key.endswith("weight") else value is want is None, key
                    checked["experts"] += key.endswith("weight")
                elif ".router." in key:
                    assert torch.equal(value, sources[0][chunk][key][kept[layer]]), key
                    checked["router"] += 1
                elif isinstance(value, torch.Tensor):
                    assert torch.equal(value, sources[0][chunk][key]), key
                    checked["other"] += 1
    assert checked["experts"] == 4 * 4 * 2 and checked["router"] == 4 and checked["other"] > 10
    args = _state(src, "mp_rank_00_000_000")["args"]
    _check_pipeline_results(run_distributed(pipeline_identity, 4, src, out, args, 4, kept, "torch", timeout=300))


def test_dist_pp2_vpp2_proxy_reshards_and_matches_masked_original(dist_checkpoints, tmp_path):
    src = dist_checkpoints("pp2_vpp")
    out = str(tmp_path / "proxy")
    run = convert_subprocess(src, out, 1, 4, "random")
    assert run.returncode == 0, run.stderr
    flags = [line for line in run.stdout.splitlines() if line.startswith("launch flags: ")]
    assert flags == ["launch flags: --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 "
                     "--num-layers-per-virtual-pipeline-stage 1 --expert-model-parallel-size 1 --num-experts 4 "
                     f"--ckpt-format torch_dist --load {out} --dist-ckpt-strictness raise_all "
                     "--finetune --no-load-optim --no-load-rng"], run.stdout  # the whole layout, nothing implied
    world = re.search(r"^accelerators: \d+ -> (\d+) \(TP=1 x PP=2 x DP=(\d+), EP=1\)$", run.stdout, re.M)
    assert int(world.group(1)) == 2 * int(world.group(2))
    assert read_launch(run.stdout) == (int(world.group(1)), flags[0].split()[2:])  # what launching scripts read
    kept, _ = _kept(out)
    assert sorted(kept) == [0, 1, 2, 3]
    source, proxy = read_all(os.path.join(src, ITER2)), read_all(os.path.join(out, ITER2))
    assert set(proxy) == set(source)
    for key, value in source.items():
        if key.startswith(("decoder.layers.mlp.experts.", "decoder.layers.mlp.router.")):
            assert proxy[key].shape[:2] == (4, 4), key
            for layer, ids in kept.items():
                assert torch.equal(proxy[key][layer], value[layer][ids]), key
        else:
            assert torch.equal(proxy[key], value), key
    args = dist_common(os.path.join(src, ITER2))["args"]
    results = run_distributed(pipeline_identity, 4, src, out, args, 4, kept, "torch_dist", timeout=300)
    _check_pipeline_results(results)
    for r in results:
        assert r["flat_masked"] <= 1e-6, r
        if r["last"]:  # the trainer's interleaved pipeline computes what the unpipelined model computes
            assert r["pp_vs_flat"] <= 1e-5, r


def test_dist_per_layer_expert_keys(dist_checkpoints, hash_folder, tmp_path):
    """--moe-layer-freq 2 makes megatron-core write every layer under its own key (`decoder.layers.{l}.`),
    experts as [E, ...] global tensors; here also legacy GroupedMLP (bf16), dense layers 1 and 3."""
    src = dist_checkpoints("grouped")
    before = hash_folder(src)
    out = str(tmp_path / "proxy")
    run = convert_subprocess(src, out, 1, 4, "random")
    assert run.returncode == 0, run.stderr
    kept, _ = _kept(out)
    assert sorted(kept) == [0, 2] and any(max(v) >= 4 for v in kept.values())
    source, proxy = read_all(os.path.join(src, ITER2)), read_all(os.path.join(out, ITER2))
    assert set(proxy) == set(source) and hash_folder(src) == before
    assert not any(k.startswith("decoder.layers.mlp.") for k in source)  # no stacked keys at all
    sliced = 0
    for key, value in source.items():
        match = re.match(r"decoder\.layers\.(\d+)\.mlp\.(experts|router)\.", key)
        if match:
            ids = kept[int(match.group(1))]
            assert value.shape[0] == 8 and proxy[key].shape == (4,) + value.shape[1:], key
            assert torch.equal(proxy[key], value[ids]), key
            sliced += 1
        else:
            assert proxy[key].dtype == value.dtype and torch.equal(proxy[key], value), key
    assert sliced == 2 * 3  # layers 0 and 2: fc1, fc2, router
    args = dist_common(os.path.join(src, ITER2))["args"]
    for r in run_distributed(dist_identity_check, 2, src, out, args, 1, 2, 1, 4, kept, timeout=300):
        assert r["masked"] <= 1e-6 * max(1.0, r["scale"]), r  # observed: exactly 0.0
        assert r["unmasked"] > 1e-3 and r["checked"]["router"] == 2, r


_SEQ = re.compile(r"local_experts\.(\d+)\.(linear_fc[12])\.(weight|_extra_state)$")
_TE = re.compile(r"(linear_fc[12])\.(weight(\d+)|_extra_state)$")


def _to_te(model):
    """SequentialMLP -> TEGroupedMLP key names: `local_experts.{i}.linear_fc1.weight` -> `linear_fc1.weight{i}`,
    one `linear_fc1._extra_state` per GroupedLinear (TE >= 2.0 stores an empty uint8 tensor without FP8)."""
    out = {}
    for key, value in model.items():
        match = _SEQ.search(key)
        if not match:
            out[key] = value
            continue
        head, (i, module, kind) = key[: match.start()], match.groups()
        if kind == "weight":
            out[f"{head}{module}.weight{i}"] = value
        else:
            out[f"{head}{module}._extra_state"] = torch.empty(0, dtype=torch.uint8)
    return out


def _from_te(model):
    """TEGroupedMLP names back to SequentialMLP's (the local spec's `_extra_state` is None)."""
    out = {}
    for key, value in model.items():
        match = _TE.search(key)
        if not match or ".experts." not in key:
            out[key] = value
            continue
        head, module, _, i = key[: match.start()], *match.groups()
        if i is not None:
            out[f"{head}local_experts.{i}.{module}.weight"] = value
            out[f"{head}local_experts.{i}.{module}._extra_state"] = None
    return out


def _rewrite(root, fn):
    for base, _, names in os.walk(root):
        if FILE in names:
            state = safe_torch_load(os.path.join(base, FILE))
            state["model"] = fn(state["model"])
            torch.save(state, os.path.join(base, FILE))


def test_te_grouped_mlp_names_emulated(checkpoints, tmp_path):
    """Transformer Engine cannot be installed on this CPU machine, so TEGroupedMLP is emulated by key
    renaming: a real SequentialMLP checkpoint's experts are renamed exactly as TEGroupedMLP's state dict
    names them in megatron-core 0.16.1 (`experts.linear_fc1.weight{i}`, one `experts.linear_fc1._extra_state`
    per GroupedLinear; megatron/core/extensions/transformer_engine.py TEGroupedLinear). The tensors are the
    same, so the converted proxy renamed back must load and match the masked original."""
    te_src = str(tmp_path / "te-src")
    shutil.copytree(checkpoints("ep2_bias"), te_src)
    _rewrite(te_src, _to_te)
    te_state = _state(te_src, "mp_rank_00_001")["model"]
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in te_state
    assert not any("local_experts" in k for k in te_state)
    out = str(tmp_path / "te-proxy")
    kept, manifest = _convert(te_src, out)
    assert any(max(v) >= 4 for v in kept.values())
    proxy = _state(out, "mp_rank_00")["model"]
    sources = [_state(te_src, f"mp_rank_00_{ep:03d}")["model"] for ep in range(2)]
    checked = 0
    for key, value in proxy.items():
        match = _TE.search(key)
        if match and match.group(3) is not None and ".experts." in key:
            g = kept[int(key.split(".")[2])][int(match.group(3))]
            assert torch.equal(value, sources[g // 4][key[: match.start()] + f"{match.group(1)}.weight{g % 4}"]), key
            checked += 1
        elif key.endswith(".mlp.experts.linear_fc1._extra_state"):
            assert value.dtype == torch.uint8 and value.numel() == 0  # carried over unchanged
            checked += 100
    assert checked == 2 * 4 * 2 + 2 * 100  # layers x K x (fc1, fc2), and each layer's fc1 _extra_state
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight4" not in proxy
    back = str(tmp_path / "proxy")  # TE names -> SequentialMLP names, then megatron-core loads it strictly
    shutil.copytree(out, back)
    _rewrite(back, _from_te)
    src = checkpoints("ep2_bias")
    for r in run_distributed(legacy_identity_check, 2, src, back, 1, 2, 1, 4, kept, timeout=300):
        assert r["masked"] <= 1e-6 * max(1.0, r["scale"]), r  # observed: exactly 0.0
        assert r["unmasked"] > 1e-3 and r["checked"]["experts"] == 2 * 4 * 2, r


def test_trainer_virtual_pipeline_flag():
    """The trainer's --num-layers-per-virtual-pipeline-stage (used for pp2_vpp): derived VPP size, refusals."""
    import pytest

    from mindspeed_proxy.training import arguments as A

    base = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--micro-batch-size", "2"]
    args = A.build_parser().parse_args(base + ["--num-layers-per-virtual-pipeline-stage", "1"])
    A.validate_world(args, 2)
    assert args.virtual_pipeline_model_parallel_size == 2
    assert A.model_config(args).extra == {"virtual_pipeline_model_parallel_size": 2}
    for extra, fragment in ((["--num-layers-per-virtual-pipeline-stage", "3"], "must divide the layers per stage 2"),
                            (["--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "6"],
                             "3 micro-batches per data-parallel rank must be a multiple")):
        with pytest.raises(A.ArgumentError, match=fragment):
            A.validate_world(A.build_parser().parse_args(base + extra), 2)
