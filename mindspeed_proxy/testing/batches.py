"""Deterministic synthetic micro-batches keyed by global sample id (same sample, same tokens, any layout)."""
from __future__ import annotations

import torch


def synthetic_sample(sample_id: int, seq_length: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Token ids [seq_length + 1] of sample `sample_id`: a noisy repeating pattern a model can learn."""
    gen = torch.Generator().manual_seed(seed * 7919 + sample_id)
    period = int(torch.randint(3, 9, (1,), generator=gen))
    pattern = torch.randint(0, vocab_size, (period,), generator=gen)
    tokens = pattern.repeat(seq_length // period + 2)[: seq_length + 1].clone()
    noise = torch.rand(seq_length + 1, generator=gen) < 0.1
    tokens[noise] = torch.randint(0, vocab_size, (int(noise.sum()),), generator=gen)
    return tokens


def synthetic_microbatches(sample_ids: list[list[int]], seq_length: int, vocab_size: int,
                           seed: int = 0) -> list[dict]:
    """Megatron-style batches (tokens, labels, loss_mask, position_ids) for lists of sample ids."""
    out = []
    for ids in sample_ids:
        rows = torch.stack([synthetic_sample(i, seq_length, vocab_size, seed) for i in ids])
        out.append({
            "tokens": rows[:, :-1].contiguous(),
            "labels": rows[:, 1:].contiguous(),
            "loss_mask": torch.ones(len(ids), seq_length),
            "position_ids": torch.arange(seq_length).unsqueeze(0).expand(len(ids), -1).contiguous(),
        })
    return out
