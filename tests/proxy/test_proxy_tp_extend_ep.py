"""MindSpeed `moe_tp_extend_ep`: experts not TP-sliced, split over EP x TP, global id (ep*TP + tp)*n + local.

MindSpeed is not installable here, so the source checkpoint is made by real megatron-core in the SAME
physical layout: TP=2 with expert-tensor-parallel size 1 and EP=4 on 4 ranks. megatron's expert rank r
then holds whole experts r*n .. r*n+n-1 with r = dp_rank*TP + tp_rank, exactly the experts MindSpeed's
BaseMoELayer gives (ep_rank, tp_rank) at TP=2 EP=2 (local_expert_indices_offset = ep_rank*n*TP +
tp_rank*n, Ascend/MindSpeed mindspeed/core/transformer/moe/moe_feature/tp_extend_ep/moe_layer.py; its
GMM init sets expert TP to 1). MindSpeed requires --moe-grouped-gemm, so the experts are legacy
GroupedMLP (bf16). The files are renamed to MindSpeed's names mp_rank_{tp}_{ep} (EP=2) and the args set
to TP=2 EP=2 moe_tp_extend_ep=True; the tensors are untouched. The proxy is renamed back the same way
and loaded into megatron-core (TP=2, ETP=1) through the real loading path for functional identity.
"""
import json
import os
import shutil

import pytest
import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.proxy.cli import main
from mindspeed_proxy.testing import run_distributed

from helpers import forward, legacy_grouped_gemm, load_model, mask_router  # noqa: E402

FLAGS = ["--num-layers", "2", "--moe-grouped-gemm", "--bf16", "--tensor-model-parallel-size", "2",
         "--expert-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "2", "--lr-warmup-iters", "1"]
FILE = "model_optim_rng.pt"


def _args(world=4):
    """The args MindSpeed would record: TP=2, EP=2, moe_tp_extend_ep."""
    from mindspeed_proxy.training import arguments as A

    args = A.build_parser().parse_args(FLAGS)
    A.validate_static(args)
    A.validate_world(args, world)
    args.moe_tp_extend_ep = True
    return args


def build_source(root):
    """Real megatron-core TP=2 / expert-TP=1 / EP=4 model on 4 ranks, saved by the trainer's legacy saver."""
    from megatron.core import parallel_state as ps

    from mindspeed_proxy.training import arguments as A
    from mindspeed_proxy.training import checkpointing as C
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mindspeed_proxy.training.engine import TrainConfig, Trainer

    args = _args()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=4,
                                 expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    cfg = A.model_config(args)
    trainer = Trainer(cfg.replace(extra={"expert_tensor_parallel_size": 1}), TrainConfig(micro_batch_size=2,
                                                                                         global_batch_size=4))
    C.save_legacy(root, 1, trainer, args)
    return (ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
            ps.get_data_parallel_rank())


def _rename(folder, mapping):
    """Rename the per-rank folders of `folder` by `mapping` {old name: new name} (two steps: no clashes)."""
    for old in mapping:
        os.rename(os.path.join(folder, old), os.path.join(folder, old + ".tmp"))
    for old, new in mapping.items():
        os.rename(os.path.join(folder, old + ".tmp"), os.path.join(folder, new))


def identity_check(src, out, k, kept):
    """On each rank: the proxy's logits vs the original's with the routers masked to the kept experts."""
    from mindspeed_proxy.testing.batches import synthetic_microbatches
    from mindspeed_proxy.training import arguments as A

    cfg = A.model_config(_args())
    batch = synthetic_microbatches([[0, 1]], cfg.seq_length, cfg.vocab_size)[0]
    original = load_model(src, cfg, tp=2, ep=4, etp=1)
    plain = forward(original, batch)
    mask_router(original, kept)
    masked = forward(original, batch)
    got = forward(load_model(out, cfg.replace(num_experts=k), tp=2, ep=2, etp=1), batch)
    return {"masked": (got - masked).abs().max().item(), "unmasked": (got - plain).abs().max().item(),
            "scale": masked.abs().max().item()}


def test_tp_extend_ep_convert_bit_exact_and_matches_masked_original(tmp_path):
    if not legacy_grouped_gemm():
        pytest.skip("this megatron-core has no legacy GroupedMLP (gone from 0.17), which MindSpeed's layout needs")
    megatron_src = str(tmp_path / "megatron-src")
    ranks = run_distributed(build_source, 4, megatron_src, timeout=300)
    assert all(ep4 == dp * 2 + tp for tp, ep4, dp in ranks)  # megatron's expert rank = MindSpeed's ep*TP + tp
    src = str(tmp_path / "mindspeed-src")  # MindSpeed's file names and args, same tensors
    shutil.copytree(megatron_src, src)
    folder = os.path.join(src, "iter_0000001")
    _rename(folder, {f"mp_rank_{tp:02d}_{ep4:03d}": f"mp_rank_{tp:02d}_{ep4 // 2:03d}" for tp, ep4, _ in ranks})
    for name in os.listdir(folder):
        path = os.path.join(folder, name, FILE)
        state = safe_torch_load(path)
        state["args"] = _args()
        torch.save(state, path)
    # K must be divisible by EP2 x TP (4 at EP2=2): K=2 is refused although EP2 alone would allow it
    assert main(["--load", src, "--save", str(tmp_path / "bad"), "--target-expert-parallel-size", "2",
                 "--target-num-experts", "2"]) == 2 and not os.path.exists(tmp_path / "bad")
    out = str(tmp_path / "proxy")
    assert main(["--load", src, "--save", out, "--target-expert-parallel-size", "1", "--target-num-experts", "4",
                 "--selection", "random", "--seed", "5"]) == 0
    manifest = json.load(open(os.path.join(out, "proxy_manifest.json")))
    kept = {e["layer"]: e["kept_global_ids_in_new_order"] for e in manifest["layers"]}
    assert sorted(kept) == [0, 1] and any(max(v) >= 4 for v in kept.values())
    out_folder = os.path.join(out, "iter_0000001")
    assert sorted(os.listdir(out_folder)) == ["mp_rank_00", "mp_rank_01"]
    n, hidden, checked = 2, 64, 0
    for t in range(2):  # proxy file t holds new ids t*n + j, whole (not TP-sliced) experts
        proxy = safe_torch_load(os.path.join(out_folder, f"mp_rank_{t:02d}", FILE))
        assert proxy["args"].moe_tp_extend_ep and proxy["args"].expert_model_parallel_size == 1
        source_t = safe_torch_load(os.path.join(folder, f"mp_rank_{t:02d}_000", FILE))["model"]
        for key, value in proxy["model"].items():
            layer = int(key.split(".")[2]) if key.startswith("decoder.layers.") else None
            if key.endswith((".experts.weight1", ".experts.weight2")):
                shape = (n, hidden, -1) if key.endswith("1") else (n, -1, hidden)
                for j in range(n):
                    g = kept[layer][t * n + j]
                    shard, local = divmod(g, n)  # MindSpeed: shard = ep*TP + tp
                    owner = f"mp_rank_{shard % 2:02d}_{shard // 2:03d}"
                    source = safe_torch_load(os.path.join(folder, owner, FILE))["model"][key]
                    assert torch.equal(value.view(shape)[j], source.view(shape)[local]), (key, t, j, g)
                    checked += 1
            elif key.endswith(".router.weight"):
                assert torch.equal(value, source_t[key][kept[layer]]), key
            elif isinstance(value, torch.Tensor):
                assert torch.equal(value, source_t[key]), key
    assert checked == 2 * 2 * 2 * n  # files x layers x (weight1, weight2) x local experts
    megatron_out = str(tmp_path / "megatron-proxy")  # megatron's names at TP=2, ETP=1, EP=2: rank t is (t, t)
    shutil.copytree(out, megatron_out)
    _rename(os.path.join(megatron_out, "iter_0000001"),
            {f"mp_rank_{t:02d}": f"mp_rank_{t:02d}_{t:03d}" for t in (0, 1)})
    for r in run_distributed(identity_check, 4, megatron_src, megatron_out, 4, kept, timeout=300):
        assert r["masked"] <= 1e-6 * max(1.0, r["scale"]), r  # bf16 GroupedMLP: observed exactly 0.0
        assert r["unmasked"] > 1e-3, r
