"""The GRPO update on a megatron-core policy: logprob passes, the clipped-ratio loss through Megatron's schedule.

One RL step's rollouts are this rank's rows of the global batch. The objective is Σ c·ℓ over the kept
tokens of the optimizer step's global batch (`aggregation.py`: c from global counts, one all-reduce):
each micro-batch contributes its Σ c·ℓ · DP · num_microbatches, which Megatron's schedule
(÷ num_microbatches) and DDP (mean over data-parallel ranks) turn into Σ_all c·ℓ, whatever the layout.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import torch

from mindspeed_proxy.rl import aggregation, replay
from mindspeed_proxy.rl.correction import Correction, rollout_correction
from mindspeed_proxy.rl.losses import KL_ESTIMATORS, grpo_token_loss
from mindspeed_proxy.rl.sampler import model_logits, next_token_logprobs
from mindspeed_proxy.training.engine import split_microbatches

STAT_KEYS = ("objective", "tokens", "clip_low", "clip_high", "clip_dual", "kl_sum", "entropy_sum", "ratio_sum",
             "is_sum", "valid")


@dataclass
class GRPOConfig:
    """GRPO settings; fields named after a Megatron-LM train_rl.py flag take its default and meaning."""

    group_size: int = 2  # --grpo-group-size
    prompts_per_step: int = 32  # --grpo-prompts-per-step
    iterations: int = 2  # --grpo-iterations: passes over one step's rollouts
    clamp_eps_lower: float = 0.01  # --grpo-clamp-eps-lower
    clamp_eps_upper: float = 0.01  # --grpo-clamp-eps-upper
    kl_beta: float = 0.001  # --grpo-kl-beta
    entropy_weight: float = 0.0  # --grpo-entropy-term-weight
    filter_groups_with_same_reward: bool = False  # --grpo-filter-groups-with-same-reward
    kl_estimator: str = "k3"  # --grpo-kl-estimator
    aggregation: str = "token-mean"  # --rl-loss-aggregation
    dual_clip: Optional[float] = None  # --rl-dual-clip
    correction: Correction = field(default_factory=Correction)  # IS / rejection / IcePop flags
    ratio_type: str = "token"  # --rl-ratio-type sequence: GSPO
    routing_replay: str = "off"  # --rl-routing-replay off|r2|r3
    temperature: float = 1.0  # --rl-default-temperature

    def __post_init__(self):
        least = {"group_size": 2, "prompts_per_step": 1, "iterations": 1}
        for name, low in least.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"GRPOConfig.{name} must be an integer >= {low}, got {value!r}")
        for name in ("clamp_eps_lower", "clamp_eps_upper", "kl_beta", "entropy_weight", "temperature"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)) or \
                    (name != "entropy_weight" and value < 0):
                raise ValueError(f"GRPOConfig.{name} must be a finite number"
                                 f"{'' if name == 'entropy_weight' else ' >= 0'}, got {value!r}")
        if self.clamp_eps_lower >= 1:
            raise ValueError(f"GRPOConfig.clamp_eps_lower must be < 1 (1 - eps stays positive), "
                             f"got {self.clamp_eps_lower}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"GRPOConfig.dual_clip must be > 1, got {self.dual_clip}")
        for name, allowed in (("kl_estimator", KL_ESTIMATORS), ("routing_replay", replay.MODES),
                              ("ratio_type", ("token", "sequence"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"GRPOConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not isinstance(self.correction, Correction):
            raise ValueError(f"GRPOConfig.correction must be a Correction, got {type(self.correction).__name__}")
        aggregation.check(self.aggregation, self.ratio_type)


def response_logprobs(logits: torch.Tensor, tokens: torch.Tensor, prompt_length: int,
                      temperature: float, with_entropy: bool = False):
    """Logprobs [B, T] of the response tokens under logits [B, S, V] (and the per-position entropy)."""
    logp = next_token_logprobs(logits[:, prompt_length - 1:-1], temperature)
    targets = tokens[:, prompt_length:].clamp_max(logp.shape[-1] - 1)
    chosen = logp.gather(2, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return chosen
    return chosen, -(logp.exp() * logp).sum(dim=-1)


def rows_routing(routing: Optional[torch.Tensor], rows: slice) -> Optional[torch.Tensor]:
    """[L, S, B, k] routing of `rows`, flattened to the router's token order [L, S·b, k]."""
    if routing is None:
        return None
    part = routing[:, :, rows]
    return part.reshape(part.shape[0], -1, part.shape[-1])


class GRPOEngine:
    """Runs the no-grad logprob passes and the GRPO optimizer steps of a `Trainer`'s model."""

    def __init__(self, trainer, cfg: GRPOConfig):
        self.trainer, self.cfg = trainer, cfg
        self.model = trainer.model[0]

    @torch.no_grad()
    def logprob_pass(self, tokens: torch.Tensor, prompt_length: int, routing: Optional[torch.Tensor] = None,
                     record: bool = False):
        """(logprobs [B, T], routing used [L, S, B, k] or None, entropy [B, T]) of the response under the
        current weights, in micro-batches; with `routing` [L, S, B, k] the experts are replayed, with
        `record` the routing the pass used is returned."""
        mbs = self.trainer.cfg.micro_batch_size
        out, used, entropies = [], [], []
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, tokens.shape[0], mbs):
                rows = slice(start, start + mbs)
                ctx = replay.replaying() if routing is not None else (
                    replay.recording() if record else contextlib.nullcontext())
                with ctx:
                    replay.set_indices(rows_routing(routing, rows))
                    logits = model_logits(self.model, tokens[rows])
                    if record:
                        recorded = replay.take_recorded() if routing is None else rows_routing(routing, rows)
                        used.append(recorded.view(recorded.shape[0], tokens.shape[1], -1, recorded.shape[-1]))
                logp, entropy = response_logprobs(logits, tokens[rows], prompt_length, self.cfg.temperature,
                                                  with_entropy=True)
                out.append(logp)
                entropies.append(entropy)
        finally:
            self.model.train(was_training)
        return torch.cat(out), (torch.cat(used, dim=2) if record else None), torch.cat(entropies)

    def loss_tokens(self, batch: dict, rows) -> torch.Tensor:
        """[b, T] bool: the tokens of `rows` that enter the loss (response mask after rejection)."""
        old = batch["old_logp"][rows]
        rollout = batch["rollout_logp"][rows] if self.cfg.correction.active else None
        return rollout_correction(old, rollout, batch["mask"][rows], self.cfg.correction)[1]

    def train_step(self, batch: dict, rows: torch.Tensor, iteration: int) -> dict:
        """One optimizer step on `rows` of `batch` (this rank's rows of the optimizer step's global batch)."""
        from megatron.core import parallel_state as ps

        mbs = self.trainer.cfg.micro_batch_size
        num_mb = split_microbatches(len(rows), mbs)
        counts = aggregation.local_counts(self.loss_tokens(batch, rows))
        torch.distributed.all_reduce(counts, group=ps.get_data_parallel_group())
        # Megatron's schedule averages over micro-batches and DDP over data-parallel ranks: undo both, so the
        # step's gradient is that of Σ c·ℓ over the global batch.
        scale = ps.get_data_parallel_world_size() * num_mb
        microbatches = []
        for start in range(0, len(rows), mbs):
            idx = rows[start:start + mbs]
            mb = {k: batch[k][idx] for k in ("tokens", "old_logp", "ref_logp", "rollout_logp", "mask", "advantages")}
            mb["routing"] = None if batch["routing"] is None else batch["routing"][:, :, idx]
            mb["prompt_length"], mb["scale"], mb["counts"] = batch["prompt_length"], scale, counts
            microbatches.append(mb)
        ctx = replay.replaying() if batch["routing"] is not None else contextlib.nullcontext()
        with ctx:
            result = self.trainer.train_step(microbatches, iteration, forward_step_func=self._forward_step,
                                             loss_key="objective")
        sums = torch.stack([r["stats"] for r in result["reports"]]).sum(dim=0) if result["reports"] else \
            torch.zeros(len(STAT_KEYS), dtype=torch.float64)
        torch.distributed.all_reduce(sums, group=ps.get_data_parallel_group())
        stats = dict(zip(STAT_KEYS, sums.tolist()))
        n = max(stats["tokens"], 1.0)
        return {"loss": stats["objective"], "grad_norm": result["grad_norm"], "lr": result["lr"],
                "skipped": result["skipped"], "nonfinite": result.get("nonfinite", False),
                "entropy": stats["entropy_sum"] / n, "kl_ref": stats["kl_sum"] / n,
                "clip_frac_low": stats["clip_low"] / n, "clip_frac_high": stats["clip_high"] / n,
                "clip_frac_dual": stats["clip_dual"] / n, "pi_over_pi_old": stats["ratio_sum"] / n,
                "is_weight_mean": stats["is_sum"] / n, "loss_tokens": int(stats["tokens"])}

    def _forward_step(self, data_iterator, model):
        mb = next(data_iterator)
        if mb["routing"] is not None:
            r = mb["routing"]
            replay.set_indices(r.reshape(r.shape[0], -1, r.shape[-1]))
        logits = model_logits(model, mb["tokens"])
        return logits, partial(self._loss, mb)

    def _loss(self, mb: dict, logits: torch.Tensor):
        cfg = self.cfg
        logp, entropy = response_logprobs(logits, mb["tokens"], mb["prompt_length"], cfg.temperature,
                                          with_entropy=True)
        token_loss, diag = grpo_token_loss(
            logp, mb["old_logp"], mb["ref_logp"], mb["advantages"], mb["mask"],
            clamp_eps_lower=cfg.clamp_eps_lower, clamp_eps_upper=cfg.clamp_eps_upper, kl_beta=cfg.kl_beta,
            kl_estimator=cfg.kl_estimator, entropy=entropy, entropy_weight=cfg.entropy_weight,
            rollout_logp=mb["rollout_logp"], correction=cfg.correction, ratio_type=cfg.ratio_type,
            dual_clip=cfg.dual_clip)
        kept = diag["kept"]
        coef = aggregation.coefficients(kept, cfg.aggregation, mb["counts"], mb["mask"].shape[1])
        objective = (token_loss * coef.to(token_loss.dtype)).sum()
        k = kept.to(torch.float64)
        with torch.no_grad():
            stats = torch.stack([
                objective.detach().double(), k.sum(), diag["clipped_low"].sum().double(),
                diag["clipped_high"].sum().double(), diag["clipped_dual"].sum().double(), (diag["kl"] * k).sum(),
                (entropy.detach().double() * k).sum(), (diag["ratio"].double() * k).sum(),
                (diag["is_weight"].double() * k).sum(), mb["mask"].bool().sum().double()])
        return objective * mb["scale"], {"objective": stats[0], "stats": stats}
