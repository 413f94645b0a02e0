"""Embedded tasks with a verifiable reward, on byte tokens (no download): the `Task` interface and a registry.

A prompt is left-padded with PAD to the task's fixed prompt length, so every rollout of a step has the
same shape (the sampler and the trainer then run identical shapes). A response ends with EOD.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from mindspeed_proxy.byte_vocab import EOD_ID

PAD_ID = 257  # inside TinyMoEConfig's vocabulary (264), outside the byte range


class Task(Protocol):
    """What the GRPO loop needs of a task: prompts, a reference answer (for SFT) and a reward."""

    name: str
    prompt_length: int  # tokens, after left padding
    max_response_length: int  # tokens, EOD included

    def sample_prompt(self, rng: random.Random) -> str:
        """One prompt text."""

    def answer(self, prompt: str) -> str:
        """The exact answer (SFT target)."""

    def reward(self, prompt: str, response: str) -> float:
        """Reward of `response` (decoded text before EOD) to `prompt`."""


@dataclass
class DigitTask:
    """Shared machinery of the digit tasks: exact answer 1.0, optional partial credit per correct position."""

    name: str
    prompt_length: int
    max_response_length: int
    make_prompt: Callable[[random.Random], str]
    solve: Callable[[str], str]
    partial_credit: float = 0.0  # weight of the per-position credit of a wrong answer (0 = exact only)

    def sample_prompt(self, rng: random.Random) -> str:
        """One prompt text."""
        return self.make_prompt(rng)

    def answer(self, prompt: str) -> str:
        """The exact answer (SFT target)."""
        return self.solve(prompt)

    def reward(self, prompt: str, response: str) -> float:
        """1.0 for the exact answer, else partial_credit × the share of target positions answered right."""
        target = self.solve(prompt)
        if response == target:
            return 1.0
        if not self.partial_credit:
            return 0.0
        right = sum(a == b for a, b in zip(response, target))
        return self.partial_credit * right / max(len(target), len(response))


def _reverse_prompt(rng: random.Random) -> str:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(4, 6)))
    return digits + "="


def _add_prompt(rng: random.Random) -> str:
    return f"{rng.randint(0, 99):02d}+{rng.randint(0, 99):02d}="


def _add_solve(prompt: str) -> str:
    a, b = prompt.rstrip("=").split("+")
    return str(int(a) + int(b))


TASKS: dict[str, Callable[[float], DigitTask]] = {
    # reverse a 4-6 digit string: "83514=" -> "41538"
    "reverse": lambda credit: DigitTask("reverse", 7, 7, _reverse_prompt, lambda p: p.rstrip("=")[::-1], credit),
    # 2-digit addition: "07+45=" -> "52"
    "add": lambda credit: DigitTask("add", 6, 4, _add_prompt, _add_solve, credit),
}


def build_task(name: str, partial_credit: float = 0.0) -> DigitTask:
    """The registered task `name`; ValueError names the known tasks."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name](partial_credit)


def encode_prompt(task: Task, prompt: str) -> list[int]:
    """Byte ids of `prompt`, left-padded with PAD to the task's prompt length."""
    ids = list(prompt.encode("ascii"))
    if len(ids) > task.prompt_length:
        raise ValueError(f"prompt {prompt!r} is longer than the task's prompt length {task.prompt_length}")
    return [PAD_ID] * (task.prompt_length - len(ids)) + ids


def decode_response(ids) -> str:
    """Text of response ids up to the first EOD (PAD and other specials dropped)."""
    out = []
    for i in (int(x) for x in ids):
        if i == EOD_ID:
            break
        if i < 256:
            out.append(i)
    return bytes(out).decode("ascii", errors="replace")


def step_prompts(task: Task, seed: int, step: int, count: int, stream: str = "rl") -> list[str]:
    """The `count` prompts of global step `step` of `stream` (rl, sft, eval): the same on every rank and layout."""
    rng = random.Random(f"{task.name}:{stream}:{seed}:{step}")
    return [task.sample_prompt(rng) for _ in range(count)]


def sft_batch(task: Task, prompts: list[str], seq_length: int) -> dict:
    """Megatron batch for SFT on the exact answers: loss on the answer tokens and the EOD only."""
    rows, masks = [], []
    for prompt in prompts:
        answer = list(task.answer(prompt).encode("ascii")) + [EOD_ID]
        ids = encode_prompt(task, prompt) + answer
        if len(ids) > seq_length + 1:
            raise ValueError(f"--seq-length {seq_length} is too short for task {task.name} ({len(ids) - 1} needed)")
        mask = [0.0] * (task.prompt_length - 1) + [1.0] * len(answer)
        rows.append(ids + [PAD_ID] * (seq_length + 1 - len(ids)))
        masks.append(mask + [0.0] * (seq_length - len(mask)))
    tokens = torch.tensor(rows, dtype=torch.long)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.tensor(masks), "position_ids": torch.arange(seq_length).expand(len(rows), -1).clone(),
            "attention_mask": None}
