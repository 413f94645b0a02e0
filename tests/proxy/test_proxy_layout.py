"""K rules, global expert ids and EP ownership (DESIGN §3-4), including MindSpeed's moe_tp_extend_ep."""
import argparse

import pytest

from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.core.layout import Layout, check_k, layout_from_args, target_layout, valid_k_values
from mindspeed_proxy.proxy.core.plan_types import rewrite_args

RULES = dict(ep2=2, tp=2, topk=2, num_experts=16)


def test_valid_k_follow_ep_groups_topk():
    assert valid_k_values(**RULES) == [2, 4, 6, 8, 10, 12, 14, 16]
    assert valid_k_values(**{**RULES, "tp_extend_ep": True}) == [4, 8, 12, 16]
    assert valid_k_values(**{**RULES, "num_groups": 4}) == [4, 8, 12, 16]
    assert valid_k_values(**{**RULES, "topk": 6, "ep2": 1}) == list(range(6, 17))
    # group-limited routing: K/groups x group_topk must still cover top-k
    assert valid_k_values(**{**RULES, "topk": 6, "num_groups": 4, "group_topk": 2}) == [12, 16]


@pytest.mark.parametrize("k,fragments", [
    (5, ["divisible by EP2 = 2", "nearest valid K: 4, 6"]),
    (1, [">= moe_router_topk = 2", "divisible by EP2", "nearest valid K: 2"]),
    (20, ["[1, 16]", "nearest valid K: 16"]),
])
def test_invalid_k_names_rule_and_nearest(k, fragments):
    with pytest.raises(ConversionError) as err:
        check_k(k, **RULES)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_tp_extend_ep_rule_is_named():
    with pytest.raises(ConversionError, match=r"EP2 x TP = 2 x 2.*nearest valid K: 4, 8"):
        check_k(6, **{**RULES, "tp_extend_ep": True})


def test_global_ids_and_owner_roundtrip():
    plain = Layout(tp=2, pp=1, ep=2, num_experts=8, dp=2)
    assert [plain.global_id(1, tp, 3) for tp in (0, 1)] == [7, 7]  # TP slices of one expert
    assert plain.owner(5, 1) == (1, 1, 1)
    ext = Layout(tp=2, pp=1, ep=2, num_experts=8, dp=2, tp_extend_ep=True)
    assert ext.num_local_experts == 2
    assert ext.global_id(ep_rank=1, tp_rank=0, local=1) == 5  # (ep*TP + tp) * n_local + local
    for g in range(8):
        tp, ep, local = ext.owner(g, 0)
        assert ext.global_id(ep, tp, local) == g
    assert ext.mapping()[5] == [1, 0, 1]


def test_target_layout_and_args_rewrite():
    args = argparse.Namespace(num_experts=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                              expert_model_parallel_size=4, world_size=8, data_parallel_size=4, lr=0.1)
    source = layout_from_args(args)
    target = target_layout(source, 2, 4)
    assert (target.world_size, target.dp, target.ep, target.tp) == (4, 2, 2, 2)
    new, diff = rewrite_args(args, target)
    assert diff == {"num_experts": [8, 4], "expert_model_parallel_size": [4, 2], "world_size": [8, 4],
                    "data_parallel_size": [4, 2]}
    assert new.lr == 0.1 and args.num_experts == 8  # a copy: the source args are untouched


def test_not_moe_and_bad_expert_split_refused():
    with pytest.raises(ConversionError, match="not an MoE checkpoint"):
        layout_from_args(argparse.Namespace(num_experts=None))
    with pytest.raises(ConversionError, match="not divisible"):
        layout_from_args(argparse.Namespace(num_experts=6, expert_model_parallel_size=4))
