"""Public API: feed the rl monitor family from an RL loop that is not ours (verl, slime, MindSpeed-RL workers).

`RolloutObserver(monitor, process_group).observe(step, ...)` takes one step's tensors as the framework holds
them on this data-parallel rank: logprobs and response mask [B, T], and the routed experts in the layout
inference engines return, [B, S, L, k] over the S = P + T positions of `input_ids` (prompt left-padded to
P, response right-padded to T). It reduces the metrics over `process_group` (the data-parallel group,
Megatron convention), hands them to the monitor's rl family and returns the step record. With the routing
probabilities and a megatron-core model (built with `moe_enable_routing_replay`) it also decomposes the
train–rollout gap (`gap.py`) every `gap_interval` steps on `gap_samples` rows per rank.
"""
from __future__ import annotations

from typing import Optional

import torch

from mindspeed_proxy.rl import gap as G
from mindspeed_proxy.rl import stats as S
from mindspeed_proxy.rl.correction import log_token_ratio
from mindspeed_proxy.rl.sampler import routing_mask


def engine_to_megatron(routed: torch.Tensor) -> torch.Tensor:
    """Inference-engine layout [B, S, L, k] to megatron-core's router order [L, S, B, k]."""
    if routed.dim() != 4:
        raise ValueError(f"routed experts / probabilities: expected [B, S, layers, top-k], got {tuple(routed.shape)}")
    return routed.permute(2, 1, 0, 3).contiguous()


def rl_family(record: dict) -> dict:
    """The rl family's sample of one step record: {metric: {layer or None: value}} (the keys it has)."""
    family = {k: dict(enumerate(record[k])) for k in ("topk_match", "load_drift") if k in record}
    family.update({k: {None: record[k]} for k in ("any_layer_mismatch", "entropy", "mismatch_k3_kl", "duplicate_share")
                   if k in record})
    return {**family, **G.gap_family(record)}


class RolloutObserver:
    """Holds the monitor handle, the data-parallel group and the state across steps (the first step's load)."""

    def __init__(self, monitor=None, process_group=None, *, num_experts: Optional[int] = None, gap_interval: int = 1,
                 gap_samples: int = 8, seed: int = 0):
        self.monitor, self.group, self.num_experts = monitor, process_group, num_experts
        self.gap_interval, self.gap_samples, self.seed = gap_interval, gap_samples, seed
        self.first_load: Optional[torch.Tensor] = None

    def observe(self, step: int, rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                response_mask: torch.Tensor, routed_experts: Optional[torch.Tensor] = None, *,
                train_routed_experts: Optional[torch.Tensor] = None, routed_probs: Optional[torch.Tensor] = None,
                model=None, input_ids: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None,
                temperature: float = 1.0, micro_batch: Optional[int] = None, replays_rollout_experts: bool = False,
                routed_positions: Optional[torch.Tensor] = None, duplicate_share: Optional[float] = None) -> dict:
        """Reduce one step's diagnostics over the data-parallel group, feed the rl family, return the record.

        rollout_logprobs / old_logprobs / response_mask / entropy: [B, T]; routed_experts, train_routed_experts
        (the training pass's), routed_probs: [B, S, L, k]; model + input_ids [B, S] + routed_probs: the gap
        decomposition (`replays_rollout_experts`: the training passes replay the rollout's experts, R3);
        routed_positions [B, S] bool: the positions whose experts are compared (default: the prompt, left-padded
        to S - T, and the inputs of the generated tokens); duplicate_share: the share of the update's samples that
        repeat one of their group (the same on every rank: logged as given)."""
        mask = response_mask.float()
        rollout_idx = engine_to_megatron(routed_experts) if routed_experts is not None else None
        train_idx = engine_to_megatron(train_routed_experts) if train_routed_experts is not None else None
        record: dict = {"type": "step", "iteration": step}
        if duplicate_share is not None:
            record["duplicate_share"] = float(duplicate_share)
        if model is not None and rollout_idx is not None and step % self.gap_interval == 0:
            if routed_probs is None or input_ids is None:
                raise ValueError("the gap decomposition needs input_ids and routed_probs with the model")
            record.update(self._gap(step, model, input_ids, mask, rollout_logprobs, rollout_idx,
                                    engine_to_megatron(routed_probs), temperature, micro_batch,
                                    replays_rollout_experts))
        if train_idx is None and replays_rollout_experts:
            train_idx = rollout_idx
        parts = [S.mismatch_sums(old_logprobs, rollout_logprobs, mask)]
        ratio = torch.exp(log_token_ratio(old_logprobs, rollout_logprobs, mask.bool()))
        importance = S.importance_sums(ratio, mask)
        parts.append(importance[:S.IMPORTANCE_MAX_ENTRY])
        if entropy is not None:
            parts.append((entropy.double() * mask).sum().view(1))
        if rollout_idx is not None and train_idx is not None:
            if routed_positions is None:
                positions = routing_mask(mask, rollout_idx.shape[1] - mask.shape[1], rollout_idx.shape[1]).reshape(-1)
            else:
                positions = routed_positions.t().reshape(-1)
            flat_train = train_idx.reshape(train_idx.shape[0], -1, train_idx.shape[-1])
            flat_rollout = rollout_idx.reshape(flat_train.shape)
            experts = self.num_experts or int(max(flat_train.max(), flat_rollout.max())) + 1
            c = S.routing_consistency_sums(flat_rollout, flat_train, positions, num_experts=experts)
            load = S.expert_load(flat_train, positions, experts)
            parts += [c["exact"], c["jaccard"], c["any_mismatch"].view(1), c["tokens"].view(1), load.view(-1)]
        flat = torch.cat([p.double().view(-1) for p in parts])
        torch.distributed.all_reduce(flat, group=self.group)
        peak = torch.stack([importance[S.IMPORTANCE_MAX_ENTRY],
                            ((old_logprobs - rollout_logprobs).abs() * mask).max().double()])
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=self.group)
        self._finish(record, flat, peak, entropy is not None, rollout_idx if train_idx is not None else None)
        if self.monitor is not None:
            self.monitor.on_rl_step(step, rl_family(record))
        return record

    def _finish(self, record, flat, peak, with_entropy, rollout_idx) -> None:
        mismatch, flat = flat[:4], flat[4:]
        record.update(S.finalize_mismatch(mismatch))
        record["mismatch_abs_logp_max"] = float(peak[1])
        record.update(S.finalize_importance(torch.cat([flat[:S.IMPORTANCE_MAX_ENTRY], peak[:1]])))
        flat = flat[S.IMPORTANCE_MAX_ENTRY:]
        tokens = max(float(mismatch[3]), 1.0)
        if with_entropy:
            record["entropy"], flat = float(flat[0]) / tokens, flat[1:]
        if rollout_idx is None:
            return
        layers = rollout_idx.shape[0]
        exact, jac, anym, toks, load = torch.split(flat, [layers, layers, 1, 1, flat.numel() - 2 * layers - 2])
        routing = S.finalize_routing({"exact": exact, "jaccard": jac, "any_mismatch": anym[0], "tokens": toks[0]})
        load = load.view(layers, -1)
        if self.first_load is None:
            self.first_load = load.clone()
        drift = S.load_drift(load, self.first_load).tolist()
        record.update({k: routing[k] for k in ("topk_match", "jaccard_mean", "topk_match_mean", "any_layer_mismatch")})
        record.update({"load_drift": drift, "load_drift_mean": sum(drift) / len(drift) if drift else 0.0})

    def _gap(self, step, model, input_ids, mask, rollout_logp, rollout_idx, rollout_probs, temperature,
             micro_batch, replays) -> dict:
        from mindspeed_proxy.patches.runtime import phase

        rows = G.sample_rows(input_ids.shape[0], self.gap_samples, self.seed, step)
        prompt_length = input_ids.shape[1] - mask.shape[1]
        idx = rollout_idx[:, :, rows]
        with phase("recompute"):  # the monitor's router family counts training passes only
            gap = G.decompose(model, input_ids[rows], prompt_length, mask[rows], rollout_logp[rows], idx,
                              rollout_probs[:, :, rows], temperature=temperature, micro_batch=micro_batch,
                              train_idx=idx if replays else None)
        sums = G.gap_sums(gap)
        torch.distributed.all_reduce(sums, group=self.group)
        return G.finalize_gap(sums)

