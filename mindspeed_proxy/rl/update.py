"""The GRPO update on a megatron-core policy: logprob passes, the clipped-ratio loss through Megatron's schedule.

One RL step's rollouts are this rank's rows of the global batch. The loss is the token mean over every
valid response token of the optimizer step's global batch: each micro-batch contributes
Σ(loss·mask) / N_global · DP · num_microbatches, which Megatron's schedule (÷ num_microbatches) and
DDP (mean over data-parallel ranks) turn into Σ_all / N_global, whatever the layout.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch

from mindspeed_proxy.rl import replay
from mindspeed_proxy.rl.losses import grpo_token_loss
from mindspeed_proxy.rl.sampler import model_logits, next_token_logprobs

STAT_KEYS = ("loss_sum", "tokens", "clip_low", "clip_high", "kl_sum", "entropy_sum", "ratio_sum", "tis_sum",
             "icepop_kept")


@dataclass
class GRPOConfig:
    """GRPO settings (Megatron-LM train_rl.py names where they exist)."""

    group_size: int = 8  # --grpo-group-size
    prompts_per_step: int = 8  # --grpo-prompts-per-step
    iterations: int = 1  # --grpo-iterations: passes over one step's rollouts
    clamp_eps_lower: float = 0.2  # --grpo-clamp-eps-lower
    clamp_eps_upper: float = 0.2  # --grpo-clamp-eps-upper
    kl_beta: float = 0.0  # --grpo-kl-beta
    entropy_weight: float = 0.0  # --grpo-entropy-term-weight
    tis_truncation: Optional[float] = None  # --rl-importance-sampling-truncation-coef (token TIS when set)
    icepop: Optional[tuple[float, float]] = None  # --rl-icepop-low/high
    ratio_type: str = "token"  # --rl-ratio-type sequence: GSPO
    routing_replay: str = "off"  # --rl-routing-replay off|r2|r3
    temperature: float = 1.0  # --rl-default-temperature


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

    def train_step(self, batch: dict, rows: torch.Tensor, iteration: int) -> dict:
        """One optimizer step on `rows` of `batch` (this rank's rows of the optimizer step's global batch)."""
        from megatron.core import parallel_state as ps

        mbs = self.trainer.cfg.micro_batch_size
        tokens_local = batch["mask"][rows].sum()
        tokens_global = tokens_local.clone().double()
        torch.distributed.all_reduce(tokens_global, group=ps.get_data_parallel_group())
        num_mb = max(len(rows) // mbs, 1)
        scale = ps.get_data_parallel_world_size() * num_mb / max(float(tokens_global), 1.0)
        microbatches = []
        for start in range(0, len(rows), mbs):
            idx = rows[start:start + mbs]
            mb = {k: batch[k][idx] for k in ("tokens", "old_logp", "ref_logp", "rollout_logp", "mask", "advantages")}
            mb["routing"] = None if batch["routing"] is None else batch["routing"][:, :, idx]
            mb["prompt_length"], mb["scale"] = batch["prompt_length"], scale
            microbatches.append(mb)
        ctx = replay.replaying() if batch["routing"] is not None else contextlib.nullcontext()
        with ctx:
            result = self.trainer.train_step(microbatches, iteration, forward_step_func=self._forward_step,
                                             loss_key="loss_sum")
        sums = torch.stack([r["stats"] for r in result["reports"]]).sum(dim=0) if result["reports"] else \
            torch.zeros(len(STAT_KEYS), dtype=torch.float64)
        torch.distributed.all_reduce(sums, group=ps.get_data_parallel_group())
        stats = dict(zip(STAT_KEYS, sums.tolist()))
        n = max(stats["tokens"], 1.0)
        return {"loss": stats["loss_sum"] / n, "grad_norm": result["grad_norm"], "lr": result["lr"],
                "skipped": result["skipped"], "entropy": stats["entropy_sum"] / n, "kl_ref": stats["kl_sum"] / n,
                "clip_frac_low": stats["clip_low"] / n, "clip_frac_high": stats["clip_high"] / n,
                "pi_over_pi_old": stats["ratio_sum"] / n, "tis_weight_mean": stats["tis_sum"] / n,
                "icepop_kept_frac": stats["icepop_kept"] / n}

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
            entropy=entropy, entropy_weight=cfg.entropy_weight, rollout_logp=mb["rollout_logp"],
            tis_truncation=cfg.tis_truncation, icepop=cfg.icepop, ratio_type=cfg.ratio_type)
        mask = mb["mask"]
        loss_sum = token_loss.sum()
        with torch.no_grad():
            stats = torch.stack([
                loss_sum.detach(), mask.sum(), diag["clipped_low"].sum(), diag["clipped_high"].sum(),
                (diag["kl"] * mask).sum(), (entropy.detach() * mask).sum(), (diag["ratio"] * mask).sum(),
                (diag["is_weight"] * mask).sum(), (diag["icepop_kept"] & mask.bool()).sum()]).double()
        return loss_sum * mb["scale"], {"loss_sum": stats[0], "stats": stats}
