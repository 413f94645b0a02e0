"""A no-grad autoregressive sampler over a megatron-core GPTModel: tokens, logprobs, routed experts and probabilities.

Every decode step runs the model over the whole fixed-length buffer (prompt + max new tokens, future
positions holding PAD): causal attention makes position p depend on positions ≤ p only, so this is
full recompute without a KV cache, with one shape for every pass (the sampler, the old/reference
logprob passes and the training pass run the same shapes; EP collectives always match). The return
value mirrors what megatron-core's inference engine reports per request (generated tokens, their
log-probabilities, routing indices), so the engine can take the sampler's place on accelerators.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from mindspeed_proxy.byte_vocab import EOD_ID
from mindspeed_proxy.rl import replay
from mindspeed_proxy.rl.tasks import PAD_ID


@dataclass
class RolloutBatch:
    """Rollouts of one step on this rank (B sequences of S = P + T tokens)."""

    tokens: torch.Tensor  # [B, S] int64: left-padded prompt, then the response (PAD after EOD)
    prompt_length: int  # P
    response_mask: torch.Tensor  # [B, T] float: 1 for generated tokens up to and including EOD
    logprobs: torch.Tensor  # [B, T] float32: sampler log-probabilities of the response tokens
    routed_experts: Optional[torch.Tensor]  # [L, S, B, k] int64: experts of every input position, or None
    routed_probs: Optional[torch.Tensor] = None  # [L, S, B, k] float32: their routing probabilities, or None

    @property
    def response(self) -> torch.Tensor:
        """[B, T] generated token ids."""
        return self.tokens[:, self.prompt_length:]

    def routing_mask(self) -> torch.Tensor:
        """[S, B] bool: the input positions whose output feeds a response logprob."""
        return routing_mask(self.response_mask, self.prompt_length, self.tokens.shape[1])


def routing_mask(response_mask: torch.Tensor, prompt_length: int, seq_length: int) -> torch.Tensor:
    """[S, B] bool: positions up to the input that produced each row's last generated token."""
    length = response_mask.sum(dim=1).long()
    last_input = prompt_length - 1 + length - 1
    return torch.arange(seq_length).unsqueeze(1) <= last_input.unsqueeze(0)


@dataclass
class SamplingParams:
    """Sampling settings (Megatron-LM inference names)."""

    temperature: float = 1.0
    top_p: float = 0.0  # nucleus sampling; 0 (Megatron-LM's "off") or 1 keep the whole distribution
    max_new_tokens: int = 7
    autocast_dtype: Optional[torch.dtype] = None  # e.g. bfloat16: the sampler in low precision (a fault)
    top_k: int = -1  # the k most likely tokens only; <= 0 = off (Megatron-LM)


def next_token_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) in float32 (the policy the trainer recomputes)."""
    return torch.log_softmax(logits.float() / max(temperature, 1e-6), dim=-1)


def sample_from(logp: torch.Tensor, uniforms: torch.Tensor, top_p: float, top_k: int = -1) -> torch.Tensor:
    """Inverse-CDF sample of one token per row of `logp` [B, V] with `uniforms` [B] in [0, 1), top-k or top-p
    filtered (top_k > 0: the k most likely tokens; 0 < top_p < 1: the smallest prefix reaching top_p)."""
    probs = logp.double().exp()
    if top_k > 0 or 0 < top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        if top_k > 0:
            keep = torch.arange(sorted_p.shape[-1], device=probs.device) < top_k
        else:
            keep = sorted_p.cumsum(dim=-1) - sorted_p < top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    cdf = probs.cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]
    return torch.searchsorted(cdf, uniforms.double().unsqueeze(-1)).clamp_max(probs.shape[-1] - 1).squeeze(-1)


def model_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [B, S, V] of a megatron GPTModel (tensor-parallel shards gathered)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    logits = model(tokens, positions, None)
    if ps.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits


class Sampler:
    """Generates rollouts from `model` (a DDP-wrapped or bare megatron GPTModel chunk)."""

    def __init__(self, model, params: SamplingParams, record_routing: bool = True):
        self.model, self.params = model, params
        self.record_routing = record_routing and replay.num_layers() > 0

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, uniforms: torch.Tensor) -> RolloutBatch:
        """Sample `params.max_new_tokens` tokens after each left-padded prompt [B, P]; `uniforms` [B, T] drive it."""
        p = self.params
        batch, prompt_len = prompt_ids.shape
        steps = p.max_new_tokens
        tokens = torch.full((batch, prompt_len + steps), PAD_ID, dtype=torch.long)
        tokens[:, :prompt_len] = prompt_ids
        logprobs = torch.zeros(batch, steps)
        mask = torch.zeros(batch, steps)
        alive = torch.ones(batch, dtype=torch.bool)
        routing = probs = None
        hooks = replay.RoutingProbabilities(self.model) if self.record_routing else None
        was_training = self.model.training
        self.model.eval()
        precision = (torch.autocast(device_type=tokens.device.type, dtype=p.autocast_dtype)
                     if p.autocast_dtype is not None else contextlib.nullcontext())
        record = replay.recording() if self.record_routing else contextlib.nullcontext([])
        try:
            with record, precision:
                for i in range(steps):
                    pos = prompt_len - 1 + i
                    logp = next_token_logprobs(model_logits(self.model, tokens)[:, pos], p.temperature)
                    if self.record_routing:
                        routing = self._keep_routing(routing, replay.take_recorded(), pos, batch)
                        probs = self._keep_routing(probs, hooks.take(), pos, batch)
                    if p.temperature == 0:
                        chosen = logp.argmax(dim=-1)
                    else:
                        chosen = sample_from(logp, uniforms[:, i], p.top_p, p.top_k)
                    chosen = torch.where(alive, chosen, torch.full_like(chosen, PAD_ID))
                    logprobs[:, i] = torch.where(alive, logp.gather(1, chosen.clamp_max(logp.shape[1] - 1)
                                                                    .unsqueeze(1)).squeeze(1), torch.zeros(()))
                    mask[:, i] = alive.float()
                    tokens[:, pos + 1] = chosen
                    alive = alive & (chosen != EOD_ID)
        finally:
            self.model.train(was_training)
            if hooks is not None:
                hooks.close()
        return RolloutBatch(tokens, prompt_len, mask, logprobs, routing, probs)

    @staticmethod
    def _keep_routing(routing, recorded: torch.Tensor, pos: int, batch: int) -> torch.Tensor:
        """Keep each position's routing from the pass where it was the newest input (as a KV cache would)."""
        layers, _, k = recorded.shape
        by_pos = recorded.view(layers, -1, batch, k)  # [L, S, B, k]
        if routing is None:
            return by_pos.clone()  # prefill: the prompt positions (later ones are overwritten as they come)
        routing[:, pos] = by_pos[:, pos]
        return routing
