"""The rl rows on Megatron-LM's own RL functions (a core_v0.16 checkout named by MEGATRON_LM_PATH).

Two gloo ranks, a tiny GPT-MoE (EP=2) built with RouterReplay. A stand-in for the dynamic engine runs the
rollouts as the engine does: all requests of a rank flattened into one [1, N] forward, each token's request
and position in a context with the engine's attribute names, read through the patched
`DynamicInferenceContext.current_input_and_position_ids`. Then Megatron-LM's real `prepare_data_for_update`
(pi_old, reference and aligned inference logprobs) runs with the rows applied, and the monitor's rl sample at
train_rl.py's iteration is checked against a float64 recomputation from the tensors Megatron-LM returned and
the logits and routing the pi_old pass saw (megatron-core's RouterReplay, independent of the rows' tap); the
gap decomposition's pass (a) equals pi_old. With `r3` the pi_old pass replays the rollout's experts: the routing
statistics read exactly no mismatch and the gap no flip. (The engine's own routing record is checked on the real
dynamic engine in tests/test_rollout_routing_engine.py.)
"""
from __future__ import annotations

import json
import math
import os
import sys

import pytest

from mindspeed_proxy.testing import run_distributed

MLM = os.environ.get("MEGATRON_LM_PATH", "")
pytestmark = pytest.mark.skipif(not MLM, reason="MEGATRON_LM_PATH is not set: these tests call Megatron-LM's "
                                                "megatron/rl (a checkout, core_v0.16 line), which CI does not have")
PROMPTS, GROUP, SEQ, STEP = 2, 4, 16, 5
EOD, PAD, VOCAB = 1, 0, 64


class Tokenizer:
    """The tokenizer fields prepare_data_for_update reads."""

    pad, eod, bos, vocab_size, vocab = PAD, EOD, None, VOCAB, {}

    def detokenize(self, ids):
        """Token ids as text."""
        return " ".join(map(str, ids))


class _Fp32Module:
    """Megatron-LM's model wrapper for an fp32 run: get_logprobs passes `fp32_output`, which only Float16Module
    takes (train_rl.py runs --bf16); this one forwards to the model and unwraps as Megatron-LM's wrappers do."""

    def __new__(cls, module):
        import torch

        class Wrapper(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.module, self.config = inner, inner.config

            def forward(self, *inputs, fp32_output=True, **kwargs):
                return self.module(*inputs, **kwargs)

        return Wrapper(module)


def _trajectories(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(PROMPTS * GROUP):
        prompt = 3 + i // GROUP
        response = 3 + int(torch.randint(0, 6, (1,), generator=g))
        body = torch.randint(2, VOCAB, (prompt + response - 1,), generator=g).tolist()
        out.append((body + [EOD], prompt))
    return out


def _engine_step(model, rows, request_ids, padded: int):
    """One flattened forward over whole requests, padded to `padded` tokens as the dynamic engine batches them
    (every EP rank runs the same token count); logprobs per request."""
    from types import SimpleNamespace

    import torch
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    active = sum(len(r) - 1 for r in rows)
    tokens = torch.tensor([t for r in rows for t in r[:-1]] + [PAD] * (padded - active))
    positions = torch.cat([torch.arange(len(r) - 1) for r in rows] + [torch.zeros(padded - active, dtype=torch.long)])
    slots = torch.cat([torch.full((len(r) - 1,), i) for i, r in enumerate(rows)]
                      + [torch.zeros(padded - active, dtype=torch.long)])
    ctx = SimpleNamespace(token_to_input_ids=tokens, token_to_pos_ids=positions, token_to_request_idx=slots,
                          request_ids=torch.tensor(request_ids), active_token_count=active,
                          padded_active_token_count=padded)
    ids, pos = DynamicInferenceContext.current_input_and_position_ids(ctx)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids, pos, None).float()[0], dim=-1)
    out, start = [], 0
    for r in rows:
        n = len(r) - 1
        out.append([float(logp[start + j, r[j + 1]]) for j in range(n)])
        start += n
    return out


def _rank(out_dir: str, mode: str):
    import torch
    import torch.distributed as dist
    from argparse import Namespace

    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    from megatron.training import global_vars

    from mindspeed_proxy import patches
    from mindspeed_proxy.monitor import MechanismMonitor, MonitorConfig
    from mindspeed_proxy.patches.rl_capture import CAPTURE
    from mindspeed_proxy.patches.runtime import RUNTIME
    from mindspeed_proxy.rl.rollout_routing import TrainRouting
    from mindspeed_proxy.testing.parallel import init_parallel
    from mindspeed_proxy.tiny_moe import TinyMoEConfig, build_model

    init_parallel(ep=2)
    rank = dist.get_rank()
    handle = patches.apply(MonitorConfig(output_dir=out_dir))
    RUNTIME.routing_replay, RUNTIME.rl_gap_interval, RUNTIME.rl_gap_samples = mode, 1, 8  # the gap on every row
    args = Namespace(fp16=False, bf16=False, cuda_graph_impl="none", rl_training_cuda_graphs=False,
                     seq_length=SEQ, decoder_seq_length=None, grpo_prompts_per_step=PROMPTS, grpo_group_size=GROUP,
                     global_batch_size=PROMPTS * GROUP, micro_batch_size=2, rl_skip_bos_token=False,
                     reset_position_ids=False, reset_attention_mask=False, rl_inference_logprobs_is_correction=True,
                     rampup_batch_size=None, decrease_batch_size_if_needed=False, curr_iteration=STEP - 1,
                     cuda_graph_scope=[], timing_log_level=0, timing_log_option="minmax", tensorboard_dir=None,
                     wandb_project="", langrl_log_dir=None)
    global_vars.set_args(args)
    global_vars._set_timers(args)
    torch.manual_seed(3)
    model = build_model(TinyMoEConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                      ffn_hidden_size=64, num_experts=8, moe_ffn_hidden_size=32, seq_length=SEQ,
                                      vocab_size=VOCAB, extra={"moe_enable_routing_replay": True}))
    RUNTIME.monitor = MechanismMonitor(RUNTIME.config, model)
    seen = {"logits": [], "routing": []}  # what the rows saw in the pi_old pass
    on_old_entropy, end = CAPTURE.on_old_entropy, TrainRouting.end

    def keep_logits(logits):
        seen["logits"].append(logits.detach().double().clone())
        return on_old_entropy(logits)

    def keep_routing(self):
        if self.current is not None and mode == "off":  # RouterReplay RECORD, independent of the rows' tap
            seen["routing"].append([r.detach().clone() for r in RouterReplay.get_recorded_data()])
        return end(self)

    CAPTURE.on_old_entropy, TrainRouting.end = keep_logits, keep_routing
    rows = _trajectories(11)
    mine = list(range(rank, len(rows), 2))  # each rank's engine runs half the requests
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)  # independent record of rollout routing
    from megatron.rl import rl_utils
    from megatron.rl.agent.api import TokenRollout

    with _rollout_phase():
        padded = max(sum(len(rows[i][0]) - 1 for i in range(r, len(rows), 2)) for r in range(2))
        logprobs = _engine_step(model, [rows[i][0] for i in mine], [100 + i for i in mine], padded)
    rollout_routing = [r.detach().clone() for r in RouterReplay.get_recorded_data()]
    RouterReplay.clear_global_router_replay_action()
    gathered = [None, None]
    dist.all_gather_object(gathered, (mine, logprobs, [r.tolist() for r in rollout_routing]))
    per_row, routing = {}, {}
    for ids, lps, rec in gathered:
        start = 0
        for i, lp in zip(ids, lps):
            per_row[i] = lp
            n = len(rows[i][0]) - 1
            routing[i] = [layer[start:start + n] for layer in rec]
            start += n
    rollouts = []
    for g in range(PROMPTS):
        group = []
        for i in range(g * GROUP, (g + 1) * GROUP):
            traj, prompt = rows[i]
            gen = [False] * prompt + [True] * (len(traj) - prompt)
            group.append(TokenRollout(trajectory=[list(traj)], reward=float(i % 3), generation_mask=[gen],
                                      logprobs=[per_row[i][prompt - 1:]], env_id="t"))
        rollouts.append(group)
    wrapped = _Fp32Module(model)
    if mode == "off":
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    iterator = rl_utils.prepare_data_for_update([wrapped], {k: (v.clone() if v is not None else v)
                                                            for k, v in wrapped.state_dict().items()},
                                                rollouts, Tokenizer(), False, True)
    RouterReplay.clear_global_router_replay_action()
    CAPTURE.on_old_entropy, TrainRouting.end = on_old_entropy, end
    batches = [next(iterator) for _ in range(2)]  # this rank's 4 rows in micro-batches of 2
    trajs = torch.cat([b[0] for b in batches])
    old, inference = torch.cat([b[2] for b in batches]), torch.cat([b[6] for b in batches])
    logits = torch.cat(seen["logits"])
    train_routing = [torch.cat([f[layer].view(SEQ, -1, f[layer].shape[-1]) for f in seen["routing"]], dim=1)
                     for layer in range(2)] if seen["routing"] else None
    split = len(rows) // 2
    local = list(range(rank * split, (rank + 1) * split))
    result = {"rank": rank, "trajs": trajs.tolist(), "old": old.double().tolist(), "inference": inference.tolist(),
              "logits": logits.tolist(),
              "train_routing": None if train_routing is None else [r.tolist() for r in train_routing],
              "rollout_routing": {i: routing[i] for i in local}, "rows": {i: rows[i] for i in local},
              "record": CAPTURE.last_record}
    RUNTIME.monitor.close()
    handle.revert()
    return result


class _rollout_phase:
    """RUNTIME.phase "rollout" with a fresh rollout table, as the patched megatron_rl_inference_mode sets."""

    def __enter__(self):
        from mindspeed_proxy.patches.rl_capture import CAPTURE
        from mindspeed_proxy.patches.runtime import RUNTIME
        from mindspeed_proxy.rl.rollout_routing import RolloutRouting

        CAPTURE.rollout, RUNTIME.phase = RolloutRouting(), "rollout"

    def __exit__(self, *exc):
        from mindspeed_proxy.patches.runtime import RUNTIME

        RUNTIME.phase = "train"


def _reference(results):
    """float64 rl-family values from what Megatron-LM returned and the independently recorded routing."""
    import torch

    abs_sum = k3 = tokens = ent = w_sum = w_sq = 0.0
    w_max = 0.0
    exact = [0.0, 0.0]
    anym = routed_tokens = 0
    for res in results:
        trajs = torch.tensor(res["trajs"])
        old, inf = torch.tensor(res["old"], dtype=torch.float64), torch.tensor(res["inference"], dtype=torch.float64)
        logits = torch.tensor(res["logits"], dtype=torch.float64)  # what selective_log_softmax got: [B, S-1, V]
        logp = torch.log_softmax(logits, -1)
        entropy = -(logp.exp() * logp).sum(-1)
        train = None if res["train_routing"] is None else [torch.tensor(r) for r in res["train_routing"]]
        for b, row in enumerate(trajs.tolist()):
            i = next(i for i, (t, _) in res["rows"].items() if row[:len(t)] == t)
            traj, prompt = res["rows"][i]
            for j in range(len(traj) - 1):
                if j + 1 >= prompt:  # the logprob at j is of generated token j + 1
                    d = float(old[b, j] - inf[b, j])
                    abs_sum, k3, tokens, ent = abs_sum + abs(d), k3 + math.expm1(d) - d, tokens + 1, \
                        ent + float(entropy[b, j])
                    w = math.exp(d)
                    w_sum, w_sq, w_max = w_sum + w, w_sq + w * w, max(w_max, w)
                if train is None:
                    continue
                differs = False
                for layer in range(2):
                    same = set(res["rollout_routing"][i][layer][j]) == set(train[layer][j, b].tolist())
                    exact[layer] += same
                    differs |= not same
                anym += differs
                routed_tokens += 1
    return {"mismatch_abs_logp_mean": abs_sum / tokens, "mismatch_k3_kl": k3 / tokens, "entropy": ent / tokens,
            "ratio_mean": w_sum / tokens, "ratio_max": w_max, "ess": w_sum * w_sum / (tokens * w_sq),
            "topk_match": [e / max(routed_tokens, 1) for e in exact],
            "any_layer_mismatch": anym / max(routed_tokens, 1)}


@pytest.mark.parametrize("mode", ["off", "r3"])
def test_rl_rows_match_float64(tmp_path, mode):
    """The rl sample at train_rl.py's iteration equals the float64 recomputation; under R3 no routing mismatch."""
    env = {"PYTHONPATH": os.pathsep.join([MLM, os.environ.get("PYTHONPATH", "")])}
    sys.path.insert(0, MLM)
    results = run_distributed(_rank, 2, str(tmp_path), mode, timeout=600, env=env)
    ref = _reference(results)
    samples = [json.loads(line) for line in open(tmp_path / "monitor.jsonl")
               if '"family": "rl"' in line and '"type": "sample"' in line]
    assert [s["step"] for s in samples] == [STEP]
    got = samples[0]["layers"]
    tolerance = {"entropy": 1e-6, "ratio_mean": 1e-6, "ratio_max": 1e-6, "ess": 1e-6}  # fp32 in the rows
    for key in ("mismatch_k3_kl", "entropy"):
        assert got["all"][key] == pytest.approx(ref[key], rel=tolerance.get(key, 1e-9), abs=1e-12), key
    record = results[0]["record"]  # the full step record (equal on every rank: reduced over data parallel)
    assert record["iteration"] == STEP and record == results[1]["record"]
    for key in ("mismatch_abs_logp_mean", "ratio_mean", "ratio_max", "ess"):
        assert record[key] == pytest.approx(ref[key], rel=tolerance.get(key, 1e-9), abs=1e-12), key
    # the gap decomposition's pass (a) is pi_old again (our log_softmax vs Megatron-LM's logsumexp, both fp32)
    assert record["gap_tokens"] == sum(len(t) - p for res in results for t, p in res["rows"].values())
    assert record["gap_abs_mean"] == pytest.approx(ref["mismatch_abs_logp_mean"], abs=1e-5)
    parts = sum(record[f"gap_{t}_abs_mean"] for t in ("flip", "weights", "other"))
    assert parts >= record["gap_abs_mean"] - 1e-12  # |a - r| <= |flip| + |weights| + |other| per token
    if mode == "off":
        assert ref["any_layer_mismatch"] > 0  # the flattened engine forward routes some tokens differently
        for layer, value in zip(sorted(k for k in got if k != "all"), ref["topk_match"]):
            assert got[layer]["topk_match"] == pytest.approx(value, abs=1e-12)
        assert got["all"]["any_layer_mismatch"] == pytest.approx(ref["any_layer_mismatch"], abs=1e-12)
        assert record["gap_flipped_token_frac"] > 0 and record["gap_flip_abs_mean"] > 0
    else:
        assert got["all"]["any_layer_mismatch"] == 0.0
        assert record["gap_flip_abs_mean"] == 0.0 and record["gap_flipped_token_frac"] == 0.0
        assert all(got[k]["topk_match"] == 1.0 for k in got if k != "all")
