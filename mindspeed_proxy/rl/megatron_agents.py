"""The digit tasks of `mindspeed_proxy.rl.tasks` as Megatron-LM RL agents, offline (no dataset download).

Megatron-LM's `train_rl.py` names its agents by dotted path in `--langrl-env-config` (a YAML list read by
`megatron.rl.agent.weighted_multi_task.WeightedMultiTask.from_config`); `env_config()` writes that list for
`DigitTaskAgent`. The agent class derives from Megatron-LM's `RewardOnlyAgent`, which exists only in a
Megatron-LM checkout (`megatron/rl` is not in the megatron-core wheel): without one, this module still imports
and its prompt and reward logic works, but `DigitTaskAgent` raises ImportError naming what is missing.
Prompts are plain task text (e.g. "83514="), tokenised by the tokenizer of `mindspeed_proxy.rl.tokenizer_dir`.
"""
from __future__ import annotations

import itertools
import random
from typing import Any

from mindspeed_proxy.rl.tasks import build_task
from mindspeed_proxy.rl.tokenizer_dir import EOD

AGENT_PATH = "mindspeed_proxy.rl.megatron_agents.DigitTaskAgent"
_COUNTERS: dict[tuple, itertools.count] = {}


def response_answer(text: str, eod: str = EOD) -> str:
    """The answer in a decoded response: the text before the first EOD, surrounding whitespace removed."""
    return text.split(eod, 1)[0].strip()


def digit_reward(task_name: str, prompt: str, response_text: str, partial_credit: float = 0.0) -> float:
    """Reward of a decoded response to `prompt` under the digit task `task_name` (its `DigitTask.reward`)."""
    return build_task(task_name, partial_credit).reward(prompt, response_answer(response_text))


def golden(task_name: str, prompt: str, index: int) -> dict:
    """The golden record Megatron-LM's agents carry with a prompt: the prompt, its answer and a problem id."""
    return {"prompt": prompt, "answer": build_task(task_name).answer(prompt), "problem_id": f"{task_name}-{index}"}


def nth_prompt(task_name: str, seed: int, index: int, validation: bool = False) -> str:
    """Prompt number `index` of the task's training (or validation) stream for `seed`: fixed per index."""
    stream = "eval" if validation else "rl"
    return build_task(task_name).sample_prompt(random.Random(f"{task_name}:{stream}:{seed}:{index}"))


def next_index(task_name: str, seed: int, validation: bool) -> int:
    """The next prompt index of this process's stream: Megatron-LM re-creates the agent at every rollout
    collection, so the position lives here, not in the agent."""
    key = (task_name, seed, validation)
    return next(_COUNTERS.setdefault(key, itertools.count()))


def env_config(task: str = "reverse", partial_credit: float = 0.0, seed: int = 1234) -> list[dict]:
    """The `--langrl-env-config` YAML content (a list of one weighted agent) for `DigitTaskAgent`."""
    build_task(task, partial_credit)  # an unknown task is refused here, not inside train_rl.py
    return [{"agent_type": AGENT_PATH, "weight": 1.0,
             "agent_args": {"task": task, "partial_credit": partial_credit, "seed": seed, "env_id": f"digits-{task}"}}]


try:
    from megatron.rl.agent.reward_only_agent import RewardOnlyAgent
except ImportError as _exc:  # no Megatron-LM checkout (or its RL deps) on the path
    _MISSING: ImportError | None = _exc
else:
    _MISSING = None

    class DigitTaskAgent(RewardOnlyAgent):
        """A `RewardOnlyAgent` over one digit task: prompts drawn offline, reward from the task."""

        env_id: str | None = "digits"
        task: str = "reverse"
        partial_credit: float = 0.0
        seed: int = 1234

        def get_dataset(self, validation: bool = False):
            """Not used: prompts are generated, there is no dataset."""
            raise NotImplementedError("DigitTaskAgent generates its prompts; it has no dataset")

        async def get_prompt(self, validation: bool = False) -> tuple[str, Any]:
            """The next prompt of this process's stream and its golden record."""
            index = next_index(self.task, self.seed, validation)
            prompt = nth_prompt(self.task, self.seed, index, validation)
            return prompt, golden(self.task, prompt, index)

        async def get_reward(self, response: str, golden: Any) -> float:
            """The task's reward of the decoded response."""
            return digit_reward(self.task, golden["prompt"], response, self.partial_credit)

        async def evaluation_prompts(self, num_prompts: int, validation: bool = False) -> list[tuple[str, Any]]:
            """The first `num_prompts` prompts of the validation (or training) stream."""
            prompts = [nth_prompt(self.task, self.seed, i, validation) for i in range(num_prompts)]
            return [(p, golden(self.task, p, i)) for i, p in enumerate(prompts)]


def __getattr__(name: str):
    if name == "DigitTaskAgent" and _MISSING is not None:
        raise ImportError(f"{AGENT_PATH} needs Megatron-LM's megatron.rl (a Megatron-LM checkout on PYTHONPATH and "
                          f"the `rl` extra): {_MISSING}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
