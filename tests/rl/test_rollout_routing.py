"""The rollout routing table of the train_rl.py rows (rl/rollout_routing.py), R3's argument checks, and the
hooked Megatron-LM names and parameters read from a checkout's source (skipped without MEGATRON_LM_PATH)."""
from __future__ import annotations

import ast
import os
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from mindspeed_proxy.rl.rollout_routing import (RolloutRouting, TrainRouting, engine_to_router_order, forward_fill,
                                                topk_of)


def _random_requests(seed: int):
    g = torch.Generator().manual_seed(seed)
    requests = {}
    for rid in range(5):
        n = int(torch.randint(3, 9, (1,), generator=g))
        requests[rid] = (torch.randint(2, 50, (n,), generator=g), torch.randint(0, 8, (2, n, 2), generator=g))
    return requests


def test_table_rebuilds_each_requests_experts_from_shuffled_engine_steps():
    """Tokens of several requests recorded in shuffled flattened steps come back per row, at their positions."""
    requests = _random_requests(0)
    flat = [(rid, pos) for rid, (tok, _) in requests.items() for pos in range(len(tok))]
    order = torch.randperm(len(flat), generator=torch.Generator().manual_seed(1)).tolist()
    table = RolloutRouting()
    for chunk in (order[:7], order[7:19], order[19:]):
        rids = torch.tensor([flat[i][0] for i in chunk])
        pos = torch.tensor([flat[i][1] for i in chunk])
        tok = torch.tensor([int(requests[r][0][p]) for r, p in zip(rids.tolist(), pos.tolist())])
        for layer in (2, 1):
            experts = torch.stack([requests[r][1][layer - 1, p] for r, p in zip(rids.tolist(), pos.tolist())])
            table.record(layer, rids, pos, tok, experts, probs=experts.float() / 10 + layer)
    seq = 12
    rows = torch.zeros(len(requests) + 1, seq, dtype=torch.long)
    for rid, (tok, _) in requests.items():  # the training row: the request's tokens, one more token, padding
        rows[rid, :len(tok)] = tok
        rows[rid, len(tok)] = 1
    rows[-1, :3] = torch.tensor([60, 61, 62])  # no request starts this row
    experts, recorded = table.lookup(rows)
    for rid, (tok, ex) in requests.items():
        n = len(tok)
        assert recorded[rid, :n].all() and not recorded[rid, n:].any()
        assert torch.equal(experts[rid, :n], ex.permute(1, 0, 2))  # [n, L, k], layers ascending
    assert not recorded[-1].any()
    again, _, probs = table.lookup(rows, with_probs=True)
    assert torch.equal(again, experts)
    assert torch.equal(probs[recorded], experts[recorded].float() / 10 + torch.tensor([1.0, 2.0]).view(1, 2, 1))
    filled = forward_fill(experts, recorded)
    for rid, (tok, ex) in requests.items():
        assert (filled[rid, len(tok):] == ex[:, -1].unsqueeze(0)).all()
    order = engine_to_router_order(filled)  # token s·B + b of layer l
    assert torch.equal(order[1, 3 * rows.shape[0] + 2], filled[2, 3, 1])


def test_topk_of_and_train_routing_layout():
    """A routing map gives its chosen experts; TrainRouting stacks forwards into [B, S, L, k]."""
    g = torch.Generator().manual_seed(2)
    chosen = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(6)])
    routing_map = torch.zeros(6, 8, dtype=torch.bool).scatter_(1, chosen, True)
    assert torch.equal(topk_of(routing_map, 2), chosen.sort(dim=1).values)
    capture = TrainRouting()
    for batch in (2, 1):
        capture.begin(batch, 3)
        for layer in (1, 3):
            capture.add(layer, torch.arange(batch * 3 * 2).view(batch * 3, 2) + 100 * layer)
        capture.end()
    out, layers = capture.take()
    assert layers == [1, 3] and out.shape == (3, 3, 2, 2)
    assert torch.equal(out[1, 2, 1], torch.tensor([310, 311]))  # forward 1, row b=1, s=2: token s·2 + b = 5 of layer 3
    capture.begin(2, 3)
    capture.add(1, torch.zeros(5, 2))  # a shard of the tokens: the capture is not comparable
    capture.end()
    assert capture.take()[0] is None


def test_r3_arguments_refused_in_one_line(capsys, monkeypatch):
    """R3 sets moe_enable_routing_replay; packing, recompute, TP > 1 and a megatron-core without RouterReplay are
    refused with exit 2 and one line."""
    from mindspeed_proxy.patches.rl_replay_args import apply_routing_replay
    from mindspeed_proxy.patches.runtime import RUNTIME

    base = dict(mechanism_routing_replay="r3", tensor_model_parallel_size=1, rl_use_sequence_packing=False,
                recompute_granularity=None)
    args = Namespace(**base)
    apply_routing_replay(args)
    assert args.moe_enable_routing_replay is True and RUNTIME.routing_replay == "r3"
    for change, word in (({"rl_use_sequence_packing": True}, "--rl-use-sequence-packing"),
                         ({"recompute_granularity": "full"}, "--recompute-granularity"),
                         ({"tensor_model_parallel_size": 2}, "--tensor-model-parallel-size 2")):
        with pytest.raises(SystemExit) as exc:
            apply_routing_replay(Namespace(**{**base, **change}))
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and word in err[0], err
    args = Namespace(**{**base, "mechanism_routing_replay": "off"})
    apply_routing_replay(args)
    assert not hasattr(args, "moe_enable_routing_replay") and RUNTIME.routing_replay == "off"
    from mindspeed_proxy.rl import replay

    monkeypatch.setattr(replay, "router_replay_class", lambda: None)
    with pytest.raises(SystemExit) as exc:
        apply_routing_replay(Namespace(**base))
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "RouterReplay" in err[0], err


MLM = os.environ.get("MEGATRON_LM_PATH", "")
# what the wrappers of patches/rl_rows.py read from each hooked function: the leading parameter names
HOOKED = {"megatron/rl/rl_utils.py": {
    "get_logprobs": ["model", "tokens", "position_ids"],
    "selective_log_softmax": ["logits", "index"],
    "align_unpacked_inference_logprobs": ["inference_logprobs", "old_logprobs_for_data", "generation_masks"],
    "prepare_data_for_update": ["model", "ref_state_dict", "rollouts", "tokenizer", "sequence_packing"],
    "_compute_logprobs_batch": ["model"], "megatron_rl_inference_mode": ["model"]}}
CONTEXT_FIELDS = ["token_to_input_ids", "token_to_pos_ids", "token_to_request_idx", "request_ids",
                  "active_token_count", "padded_active_token_count"]


@pytest.mark.skipif(not MLM, reason="MEGATRON_LM_PATH is not set: the hooked signatures are read from a checkout")
def test_hooked_signatures_match_the_checkout():
    """The checkout's hooked functions take the parameters the rows read; its engine context has the fields."""
    root = Path(MLM)
    for path, functions in HOOKED.items():
        tree = ast.parse((root / path).read_text())
        defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for name, params in functions.items():
            assert name in defs, f"{path}: no {name}"
            assert [a.arg for a in defs[name].args.args][:len(params)] == params, name
    source = (root / "megatron/core/inference/contexts/dynamic_context.py").read_text()
    assert "def current_input_and_position_ids(" in source
    for field in CONTEXT_FIELDS:
        assert f"self.{field} = " in source, field


def test_r3_routes_a_pass_without_replay_when_a_row_matches_no_rollout(monkeypatch, caplog):
    """R3 never stops training: a pass with a row that no recorded request starts routes without replay, is
    counted, and the warning is logged once; a pass whose rows all match gets the table's experts."""
    from mindspeed_proxy.patches.rl_capture import Capture
    from mindspeed_proxy.patches.runtime import RUNTIME

    monkeypatch.setattr(RUNTIME, "routing_replay", "r3")
    capture = Capture()
    capture.top_k = 2
    table = RolloutRouting()
    tokens = torch.tensor([5, 6, 7, 8])
    experts = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    for layer in (1, 2):
        table.record(layer, torch.zeros(4, dtype=torch.long), torch.arange(4), tokens, experts + layer - 1)
    capture.table = table
    matched = capture.replay_indices(torch.tensor([[5, 6, 7, 8, 9]]))
    assert matched is not None and matched.shape == (2, 5, 2)
    assert capture.r3_unreplayed_passes == 0
    with caplog.at_level("WARNING", logger="mindspeed_proxy"):
        for _ in range(2):
            assert capture.replay_indices(torch.tensor([[5, 6, 7, 8, 9], [9, 6, 7, 8, 5]])) is None
    assert capture.r3_unreplayed_passes == 2
    assert [r.getMessage() for r in caplog.records].count(
        "mindspeed-proxy: R3: 1 of 2 training rows match no rollout the engine ran (their tokens start no recorded "
        "request); that pass routes without replay (counted in r3_unreplayed_passes; logged once)") == 1


def test_rollout_phase_spans_the_engine_work_inside_the_exit(monkeypatch):
    """A rank other than 0 yields at once from Megatron-LM's megatron_rl_inference_mode and its engine serves its
    requests inside the exit's `suspend()`: the wrapped context keeps RUNTIME.phase "rollout" (and the fresh rollout
    table) there too, restores the phase after, and also when the body raises."""
    import contextlib

    from mindspeed_proxy.patches.rl_capture import CAPTURE
    from mindspeed_proxy.patches.rl_rows import inference_mode_wrapper
    from mindspeed_proxy.patches.runtime import RUNTIME

    seen = []

    @contextlib.contextmanager
    def megatron_rl_inference_mode(model):  # Megatron-LM's shape: resume, yield, then suspend (engine steps)
        seen.append(("resume", RUNTIME.phase))
        yield "interface"
        seen.append(("suspend", RUNTIME.phase))
        CAPTURE.rollout.record(1, torch.tensor([3]), torch.tensor([0]), torch.tensor([9]), torch.tensor([[0, 1]]))

    monkeypatch.setattr(RUNTIME, "phase", "train")
    monkeypatch.setattr(CAPTURE, "rollout", RolloutRouting())
    CAPTURE.rollout.record(1, torch.tensor([7]), torch.tensor([0]), torch.tensor([4]), torch.tensor([[2, 3]]))
    wrapped = inference_mode_wrapper(megatron_rl_inference_mode)
    with wrapped(["model"]) as interface:  # rank 1: nothing in the body
        assert interface == "interface" and RUNTIME.phase == "rollout"
    assert seen == [("resume", "rollout"), ("suspend", "rollout")] and RUNTIME.phase == "train"
    assert list(CAPTURE.rollout.requests) == [(0, 3)]  # a fresh table, filled inside the exit
    with pytest.raises(ValueError):
        with wrapped(["model"]):
            raise ValueError("the body failed")
    assert RUNTIME.phase == "train" and CAPTURE.context is None


@pytest.mark.skipif(not MLM, reason="MEGATRON_LM_PATH is not set: the context manager is read from a checkout")
def test_checkout_inference_mode_suspends_the_engine_after_its_yield():
    """The shape the phase test above stands in for: the checkout's megatron_rl_inference_mode runs
    `inference_interface.suspend()` after its `yield`, and rank 0 alone drives the rollout generator in the body."""
    source = (Path(MLM) / "megatron/rl/rl_utils.py").read_text()
    body = source[source.index("def megatron_rl_inference_mode("):]
    assert body.index("yield inference_interface") < body.index("inference_interface.suspend()")
    assert "if rank == 0:" in source[source.index("def get_environment_rollouts("):source.index(
        "def megatron_rl_inference_mode(")]


def test_duplicate_share_counts_repeats_within_groups_only():
    """duplicate_share against a count of repeats per group on random groups; equal samples in different groups are
    not repeats; the capture reads Megatron-LM's rollouts by their trajectory and logs the share once with DP > 1."""
    import collections
    import random

    from mindspeed_proxy.rl.stats import duplicate_share

    rng = random.Random(3)
    groups = [[tuple(rng.choice([(1, 2), (1, 3), (2, 2)]) for _ in range(rng.randint(1, 3)))
               for _ in range(rng.randint(1, 6))] for _ in range(50)]
    total = sum(len(g) for g in groups)
    repeats = sum(c - 1 for g in groups for c in collections.Counter(g).values())
    assert duplicate_share(groups) == repeats / total and 0 < repeats < total
    assert duplicate_share([["a", "b"], ["a", "b"]]) == 0.0 and duplicate_share([]) is None
    assert duplicate_share([["a", "a", "b", "b"]]) == 0.5  # two data-parallel engines drawing the same pairs

    from mindspeed_proxy.patches.rl_capture import Capture

    class Rollout:  # Megatron-LM's TokenRollout carries trajectory: list[list[int]]
        def __init__(self, trajectory):
            self.trajectory = trajectory

    capture = Capture()
    capture.on_rollouts([[Rollout([[1, 2, 3]]), Rollout([[1, 2, 3]]), Rollout([[1, 2, 4]]), Rollout([[1, 2, 4]])],
                         [Rollout([[5, 6]]), Rollout([[5, 7]]), Rollout([[5, 6]]), Rollout([[5, 8]])]])
    assert capture.duplicates == 3 / 8
    capture.on_rollouts(None)
    assert capture.duplicates is None


def test_duplicate_share_reaches_the_rl_record_and_the_family(tmp_path):
    """The observer logs the share it is given in the step record and the rl family's sample."""
    import torch.distributed as dist

    from mindspeed_proxy.rl.observe import RolloutObserver, rl_family

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        logp = torch.full((2, 3), -1.0)
        record = RolloutObserver().observe(1, logp, logp, torch.ones(2, 3), duplicate_share=0.25)
        assert record["duplicate_share"] == 0.25 and rl_family(record)["duplicate_share"] == {None: 0.25}
        assert "duplicate_share" not in RolloutObserver().observe(2, logp, logp, torch.ones(2, 3))
    finally:
        dist.destroy_process_group()
