"""The per-head Wq/Wk blocks reproduce megatron-core's own query/key projections (MHA, GQA, MQA, TP, q/k norm)."""
import pytest
import torch

from mindspeed_proxy.monitor.qk_layout import layernorm_scale, layout_of, qk_blocks
from mindspeed_proxy.monitor.reductions import MonitorGroups, gather_tp
from mindspeed_proxy.testing import run_distributed
from mindspeed_proxy.layout_init import global_init
from mindspeed_proxy.testing.parallel import init_parallel
from mindspeed_proxy.tiny_moe import TinyMoEConfig, build_model


def projection_check(tp, heads, groups, qk_norm):
    """Max error between megatron's q/k heads and x @ block for this rank's heads."""
    init_parallel(tp=tp)
    cfg = TinyMoEConfig(num_layers=1, num_attention_heads=heads, num_query_groups=groups, qk_layernorm=qk_norm,
                        sequence_parallel=False, num_experts=0)
    model = build_model(cfg)
    global_init(model, seed=11)
    attn = model.decoder.layers[0].self_attention
    with torch.no_grad():
        if qk_norm:  # non-trivial scales so that folding them matters
            attn.q_layernorm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
            attn.k_layernorm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
        x = torch.randn(5, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        query, key, _ = attn.get_query_key_value_tensors(x)  # [s, b, heads_local, h], [s, b, groups_local, h]
        layout = layout_of(attn)
        weight = attn.linear_qkv.weight
        if layout.needs_full_weight:
            weight = gather_tp(weight, MonitorGroups.from_parallel_state())
        wq, wk = qk_blocks(weight, layout, layernorm_scale(attn.q_layernorm), layernorm_scale(attn.k_layernorm))
        xs = x[:, 0]
        q_ref = query[:, 0]  # [s, heads_local, h]
        k_ref = key[:, 0].repeat_interleave(query.shape[2] // key.shape[2], dim=1)  # each head's KV group
        q_blk = torch.einsum("sd,ndh->snh", xs, wq)
        k_blk = torch.einsum("sd,ndh->snh", xs, wk)
        if qk_norm:  # megatron normalises per head, then scales: undo the normalisation only
            q_raw = torch.einsum("sd,ndh->snh", xs, wq / layernorm_scale(attn.q_layernorm).view(1, 1, -1))
            k_raw = torch.einsum("sd,ndh->snh", xs, wk / layernorm_scale(attn.k_layernorm).view(1, 1, -1))
            q_ref = q_ref * q_raw.square().mean(-1, keepdim=True).add(attn.q_layernorm.eps).sqrt()
            k_ref = k_ref * k_raw.square().mean(-1, keepdim=True).add(attn.k_layernorm.eps).sqrt()
        return {"heads": layout.local_heads(), "q": float((q_blk - q_ref).abs().max()),
                "k": float((k_blk - k_ref).abs().max()), "scale": float(q_ref.abs().max())}


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
def test_blocks_reproduce_megatron_projections_tp1(heads, groups, qk_norm):
    (out,) = run_distributed(projection_check, 1, 1, heads, groups, qk_norm)
    assert out["heads"] == list(range(heads))
    assert out["q"] <= 1e-5 * out["scale"] and out["k"] <= 1e-5 * out["scale"], out


@pytest.mark.parametrize("groups", [2, 1], ids=["gqa-groups>=tp", "mqa-groups<tp"])
def test_blocks_reproduce_megatron_projections_tp2(groups):
    outs = run_distributed(projection_check, 2, 2, 4, groups, False)
    assert [o["heads"] for o in outs] == [[0, 1], [2, 3]]
    for out in outs:
        assert out["q"] <= 1e-5 * out["scale"] and out["k"] <= 1e-5 * out["scale"], out
