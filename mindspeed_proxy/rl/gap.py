"""Train–rollout logprob gap, decomposed: expert flips + routing weights + everything else.

Extra no-grad forwards of the training model on a sample of the batch: (a) the training pass's routing
(its own, or the rollout's experts under R3), (b) the rollout's experts replayed, probabilities recomputed
by the trainer's router, (c) the rollout's experts and probabilities both replayed. Per token, in float64,
gap = (a − b) + (b − c) + (c − rollout) = flip + weights + other: the terms telescope to the total
exactly; "other" is numerics, kernels and stale weights. Optionally one forward per MoE layer with the
rollout's experts replayed in that layer only: |a − that| says how much of the gap that layer's flips make.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from mindspeed_proxy.monitor.detectors import GAP_CAUSES
from mindspeed_proxy.rl import replay
from mindspeed_proxy.rl.sampler import model_logits
from mindspeed_proxy.rl.update import response_logprobs, rows_routing

TERMS = ("flip", "weights", "other")
CAUSES = {term: label for term, (label, _) in GAP_CAUSES.items()}
_FIXED = 6  # gap_sums entries before the per-layer ones


@dataclass
class Gap:
    """Per-token logprobs [b, T] float64 of the passes, the rollout's, and what the attribution needs."""

    train: torch.Tensor  # (a)
    indices: torch.Tensor  # (b)
    both: torch.Tensor  # (c)
    rollout: torch.Tensor
    mask: torch.Tensor  # [b, T] response tokens
    flipped: torch.Tensor  # [b, T] bool: a routing flip at or before the token's input position
    routing: torch.Tensor  # [L, S, b, k] the experts pass (a) used
    layers: Optional[torch.Tensor] = None  # [L, b, T] float64: rollout's experts replayed in layer l only

    def terms(self) -> dict[str, torch.Tensor]:
        """Per-token flip, weights, other and total (train − rollout) in float64."""
        return {"flip": self.train - self.indices, "weights": self.indices - self.both,
                "other": self.both - self.rollout, "total": self.train - self.rollout}


@torch.no_grad()
def logprob_pass(model, tokens: torch.Tensor, prompt_length: int, *, temperature: float = 1.0,
                 micro_batch: Optional[int] = None, indices: Optional[torch.Tensor] = None,
                 probs: Optional[torch.Tensor] = None, layers: Optional[list[int]] = None, record: bool = False):
    """(response logprobs [B, T] float64, routing used [L, S, B, k] or None) of `model` on `tokens` [B, S].

    `indices` [L, S, B, k] replays the experts (in `layers` only when given), `probs` [L, S, B, k] their
    probabilities as well; `record` returns the routing the pass used."""
    mbs = micro_batch or tokens.shape[0]
    hooks = replay.RoutingProbabilities(model) if probs is not None else None
    out, used = [], []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, tokens.shape[0], mbs):
            rows = slice(start, start + mbs)
            if indices is None:
                ctx = replay.recording() if record else contextlib.nullcontext()
            elif layers is None:
                ctx = replay.replaying()
            else:
                ctx = replay.replaying_layers(layers, rows_routing(indices, rows))
            with ctx:
                if indices is not None and layers is None:
                    replay.set_indices(rows_routing(indices, rows))
                if hooks is not None:
                    hooks.replay = list(rows_routing(probs, rows).unbind(0))
                logits = model_logits(model, tokens[rows])
                if record:
                    r = replay.take_recorded() if indices is None else rows_routing(indices, rows)
                    used.append(r.view(r.shape[0], tokens.shape[1], -1, r.shape[-1]))
            out.append(response_logprobs(logits, tokens[rows], prompt_length, temperature).double())
    finally:
        model.train(was_training)
        if hooks is not None:
            hooks.close()
    return torch.cat(out), (torch.cat(used, dim=2) if record else None)


def flipped_tokens(train_idx: torch.Tensor, rollout_idx: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """[B, T] bool: response tokens that a flip can reach: some position up to the token's input position
    has another top-k set (order ignored) in some layer (causal attention carries a flip forward)."""
    differ = (train_idx.sort(dim=-1).values != rollout_idx.sort(dim=-1).values).any(dim=-1).any(dim=0)  # [S, B]
    reached = differ.int().cummax(dim=0).values.bool()
    return reached[prompt_length - 1:-1].t()


def decompose(model, tokens: torch.Tensor, prompt_length: int, mask: torch.Tensor, rollout_logp: torch.Tensor,
              rollout_idx: torch.Tensor, rollout_probs: torch.Tensor, *, temperature: float = 1.0,
              micro_batch: Optional[int] = None, train_idx: Optional[torch.Tensor] = None,
              per_layer: bool = False) -> Gap:
    """The decomposition on `tokens` [B, S] (routing tensors [L, S, B, k]); `train_idx`: the training pass's
    replayed experts (R3), None when it routes on its own."""
    run = dict(temperature=temperature, micro_batch=micro_batch)
    indices, _ = logprob_pass(model, tokens, prompt_length, indices=rollout_idx, **run)
    if train_idx is not None and torch.equal(train_idx, rollout_idx):
        train, used = indices, rollout_idx  # R3: pass (a) is pass (b)
    else:
        train, used = logprob_pass(model, tokens, prompt_length, indices=train_idx, record=True, **run)
    both, _ = logprob_pass(model, tokens, prompt_length, indices=rollout_idx, probs=rollout_probs, **run)
    layers = None
    if per_layer:
        layers = torch.stack([logprob_pass(model, tokens, prompt_length, indices=rollout_idx, layers=[layer],
                                           **run)[0] for layer in range(rollout_idx.shape[0])])
    return Gap(train, indices, both, rollout_logp.double(), mask.bool(),
               flipped_tokens(used, rollout_idx, prompt_length), used, layers)


@torch.no_grad()
def gap_sums(gap: Gap) -> torch.Tensor:
    """float64 [Σ|flip|, Σ|weights|, Σ|other|, Σ|total|, #flipped, #tokens, Σ|train − layer l| per layer]
    over the response tokens; every entry SUM-reduces over data-parallel ranks."""
    m = gap.mask
    terms = gap.terms()
    fixed = [terms[k][m].abs().sum() for k in (*TERMS, "total")]
    fixed += [gap.flipped[m].sum().double(), m.sum().double()]
    per_layer = [] if gap.layers is None else [(gap.train - layer)[m].abs().sum() for layer in gap.layers]
    return torch.stack([t.double() for t in fixed + per_layer])


def finalize_gap(sums: torch.Tensor) -> dict[str, object]:
    """Mean |·| of each term and of the total, each term's share of Σ|terms|, the flipped-token fraction,
    the dominant cause (`gap_cause`) and, when measured, the per-layer flip attribution."""
    values = [float(v) for v in sums]
    flip, weights, other, total, flipped, tokens = values[:_FIXED]
    n, parts = max(tokens, 1.0), flip + weights + other
    record = {"gap_abs_mean": total / n, "gap_tokens": int(tokens), "gap_flipped_token_frac": flipped / n}
    for name, value in zip(TERMS, (flip, weights, other)):
        record[f"gap_{name}_abs_mean"] = value / n
        record[f"gap_{name}_share"] = value / parts if parts > 0 else 0.0
    record["gap_cause"] = CAUSES[max(TERMS, key=lambda t: record[f"gap_{t}_share"])] if parts > 0 else "none"
    if len(values) > _FIXED:
        record["gap_layer_flip_abs_mean"] = [v / n for v in values[_FIXED:]]
    return record


def sample_rows(rows: int, samples: int, seed: int, step: int) -> torch.Tensor:
    """Sorted indices of `samples` of this rank's `rows` rows, drawn from (seed, step)."""
    generator = torch.Generator().manual_seed(seed * 7_919 + step)
    return torch.randperm(rows, generator=generator)[:min(samples, rows)].sort().values


def loop_gap(engine, batch, args, step: int, group=None) -> dict[str, object]:
    """The decomposition of our GRPO loop's step on `--rl-gap-samples` rows per rank, reduced over `group`."""
    rows = sample_rows(batch.tokens.shape[0], args.rl_gap_samples, args.seed, step)
    idx, probs = batch.routed_experts[:, :, rows], batch.routed_probs[:, :, rows]
    per_layer = bool(args.rl_gap_layer_interval) and step % args.rl_gap_layer_interval == 0
    gap = decompose(engine.model, batch.tokens[rows], batch.prompt_length, batch.response_mask[rows],
                    batch.logprobs[rows], idx, probs, temperature=engine.cfg.temperature,
                    micro_batch=engine.trainer.cfg.micro_batch_size,
                    train_idx=idx if engine.cfg.routing_replay == "r3" else None, per_layer=per_layer)
    sums = gap_sums(gap)
    torch.distributed.all_reduce(sums, group=group)
    return finalize_gap(sums)


def gap_family(record: dict) -> dict:
    """The rl family's gap metrics of a record that has them ({} otherwise)."""
    if "gap_abs_mean" not in record:
        return {}
    family = {k: {None: record[k]} for k in ("gap_abs_mean", "gap_flip_share", "gap_weights_share",
                                              "gap_other_share", "gap_flipped_token_frac")}
    if "gap_layer_flip_abs_mean" in record:
        family["gap_layer_flip_abs_mean"] = dict(enumerate(record["gap_layer_flip_abs_mean"]))
    return family
