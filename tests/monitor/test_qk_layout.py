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


def test_group_shared_keys_keeps_one_key_block_per_group():
    from mindspeed_proxy.monitor.qk_layout import QKLayout, group_shared_keys
    from mindspeed_proxy.monitor.spectral import qk_increment_singular_values

    gen = torch.Generator().manual_seed(3)
    layout = QKLayout(num_heads=6, num_groups=2, head_dim=4)
    rows = layout.num_groups * (layout.heads_per_group + 2) * layout.head_dim
    old = torch.randn(rows, 32, generator=gen)
    new = old + 1e-3 * torch.randn(rows, 32, generator=gen)
    (wq_o, wk_o), (wq_n, wk_n) = qk_blocks(old, layout), qk_blocks(new, layout)
    grouped = group_shared_keys(wq_o, wk_o, wq_n, wk_n, layout)
    assert [tuple(x.shape) for x in grouped] == [(2, 3, 32, 4), (2, 1, 32, 4)] * 2
    for g in range(2):
        for j in range(3):  # the kept key block is the one every head of the group uses
            assert torch.equal(grouped[1][g, 0], wk_o[3 * g + j]) and torch.equal(grouped[0][g, j], wq_o[3 * g + j])
    sv = qk_increment_singular_values(*grouped).flatten(0, -2)
    assert torch.allclose(sv, qk_increment_singular_values(wq_o, wk_o, wq_n, wk_n), rtol=1e-6, atol=0)
    mha = QKLayout(num_heads=4, num_groups=4, head_dim=4)
    blocks = qk_blocks(torch.randn(4 * 3 * 4, 32, generator=gen), mha) * 2
    assert all(a is b for a, b in zip(group_shared_keys(*blocks, mha), blocks))
    split = QKLayout(num_heads=4, num_groups=1, head_dim=4, tp_size=2)  # needs_full_weight: unchanged
    assert all(a is b for a, b in zip(group_shared_keys(*blocks, split), blocks))
