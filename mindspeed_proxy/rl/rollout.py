"""One step's rollouts on this data-parallel rank: its share of the global prompts, sampled and rewarded.

Prompts and sampling noise are drawn for the whole global batch from (seed, step) and sliced by the
data-parallel rank, so a step's rollouts do not depend on the parallel layout.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mindspeed_proxy.rl.sampler import RolloutBatch, Sampler
from mindspeed_proxy.rl.tasks import Task, decode_response, encode_prompt, step_prompts


@dataclass
class StepRollouts:
    """This rank's rollouts of one step: groups of `group_size` consecutive rows, one prompt each."""

    batch: RolloutBatch
    prompts: list[str]  # one per row
    responses: list[str]
    rewards: torch.Tensor  # [rows] float64


def data_parallel_slice(total: int) -> slice:
    """This data-parallel rank's contiguous share of `total` items."""
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = total // dp
    return slice(rank * per, (rank + 1) * per)


def step_uniforms(seed: int, step: int, rows: int, length: int) -> torch.Tensor:
    """The uniform numbers [rows, length] that drive sampling of the global batch at `step`."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.rand(rows, length, generator=generator)


def sample_step(sampler: Sampler, task: Task, seed: int, step: int, num_prompts: int, group_size: int,
                phase=contextlib.nullcontext, stream: str = "rl") -> StepRollouts:
    """Sample `group_size` rollouts of this rank's prompts of global step `step` and score them."""
    prompts = step_prompts(task, seed, step, num_prompts, stream)[data_parallel_slice(num_prompts)]
    rows = [p for p in prompts for _ in range(group_size)]
    ids = torch.tensor([encode_prompt(task, p) for p in rows], dtype=torch.long)
    length = sampler.params.max_new_tokens
    uniforms = step_uniforms(seed, step, num_prompts * group_size, length)[data_parallel_slice(num_prompts * group_size)]
    with phase():
        batch = sampler.generate(ids, uniforms)
    responses = [decode_response(r) for r in batch.response.tolist()]
    rewards = torch.tensor([task.reward(p, r) for p, r in zip(rows, responses)], dtype=torch.float64)
    return StepRollouts(batch, rows, responses, rewards)


def evaluate(sampler: Sampler, task: Task, seed: int, num_prompts: int, samples: int = 4, rounds: int = 1) -> dict:
    """Mean reward and exact-match rate of `samples` rollouts of held-out prompts, over all data-parallel ranks."""
    from megatron.core import parallel_state as ps

    sums = torch.zeros(3, dtype=torch.float64)
    for r in range(rounds):
        out = sample_step(sampler, task, seed, r, num_prompts, samples, stream="eval")
        sums += torch.tensor([out.rewards.sum(), (out.rewards == 1.0).sum(), out.rewards.numel()], dtype=torch.float64)
    torch.distributed.all_reduce(sums, group=ps.get_data_parallel_group())
    return {"eval_reward": float(sums[0] / sums[2]), "eval_exact_match": float(sums[1] / sums[2]),
            "eval_rollouts": int(sums[2])}
