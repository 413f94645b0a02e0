"""The offline agent and tokenizer folder for Megatron-LM's train_rl.py, without a Megatron-LM checkout."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import re
from pathlib import Path

import pytest
import yaml

from mindspeed_proxy.cli import main as cli_main
from mindspeed_proxy.rl import megatron_agents as agents
from mindspeed_proxy.rl.tokenizer_dir import write_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _reverse_reward(prompt: str, text: str, credit: float) -> float:
    """Independent reference: exact reversal 1.0, else credit x matching positions / the longer length."""
    answer, target = text.split("<eod>")[0].strip(), prompt[:-1][::-1]
    if answer == target:
        return 1.0
    return credit * sum(a == b for a, b in zip(answer, target)) / max(len(answer), len(target))


def test_reward_matches_an_independent_reference():
    """Random prompts and responses (exact, EOD-terminated, corrupted, truncated): the agent's reward equals
    the reference, and exact answers get 1.0 and only they do when partial credit is off."""
    rng = random.Random(7)
    for index in range(200):
        prompt = agents.nth_prompt("reverse", 1234, index)
        assert re.fullmatch(r"[0-9]{4,6}=", prompt)
        target = prompt[:-1][::-1]
        kind = index % 4
        if kind == 0:
            text = target
        elif kind == 1:
            text = target + "<eod>" + "".join(rng.choice("0123456789") for _ in range(3))
        elif kind == 2:
            pos = rng.randrange(len(target))
            text = target[:pos] + str((int(target[pos]) + 1) % 10) + target[pos + 1:] + "<eod>"
        else:
            text = target[: rng.randrange(len(target))]
        for credit in (0.0, 0.5):
            got = agents.digit_reward("reverse", prompt, text, credit)
            assert got == pytest.approx(_reverse_reward(prompt, text, credit), abs=1e-12)
            if credit == 0.0:
                assert got == (1.0 if kind in (0, 1) else 0.0)


def test_add_task_reward_and_golden():
    """The addition task: golden answer is the sum, the reward follows it."""
    for index in range(50):
        prompt = agents.nth_prompt("add", 3, index)
        a, b = (int(x) for x in prompt.rstrip("=").split("+"))
        record = agents.golden("add", prompt, index)
        assert record == {"prompt": prompt, "answer": str(a + b), "problem_id": f"add-{index}"}
        assert agents.digit_reward("add", prompt, f"{a + b}<eod>") == 1.0
        assert agents.digit_reward("add", prompt, f"{a + b + 1}<eod>") == 0.0


def test_prompt_streams_are_fixed_per_index():
    """Prompt i depends on (task, seed, split, i) only; the process counter hands out 0, 1, 2, ..."""
    first = [agents.nth_prompt("reverse", 5, i) for i in range(20)]
    assert first == [agents.nth_prompt("reverse", 5, i) for i in range(20)]
    assert len(set(first)) > 15
    assert first != [agents.nth_prompt("reverse", 6, i) for i in range(20)]
    assert first != [agents.nth_prompt("reverse", 5, i, validation=True) for i in range(20)]
    key = ("reverse", 987654, False)
    agents._COUNTERS.pop(key, None)
    assert [agents.next_index(*key) for _ in range(3)] == [0, 1, 2]
    agents._COUNTERS.pop(key, None)


def test_env_config_and_shipped_example():
    """env_config() is what WeightedMultiTask.from_config reads; the shipped example is env_config('reverse');
    an unknown task is refused when the config is made."""
    config = agents.env_config("add", partial_credit=0.25, seed=9)
    assert config == [{"agent_type": "mindspeed_proxy.rl.megatron_agents.DigitTaskAgent", "weight": 1.0,
                       "agent_args": {"task": "add", "partial_credit": 0.25, "seed": 9, "env_id": "digits-add"}}]
    shipped = yaml.safe_load((ROOT / "examples" / "configs" / "megatron_rl_digits.yaml").read_text())
    assert shipped == agents.env_config("reverse")
    with pytest.raises(ValueError, match="unknown task 'mul'"):
        agents.env_config("mul")


def test_agent_class_with_or_without_megatron_lm():
    """Without megatron.rl the agent names what is missing; with it, it is a pydantic RewardOnlyAgent whose
    prompt and reward come from the task."""
    if importlib.util.find_spec("megatron.rl") is None:
        with pytest.raises(ImportError, match="needs Megatron-LM's megatron.rl"):
            agents.DigitTaskAgent  # noqa: B018
        return
    from megatron.rl.agent.reward_only_agent import RewardOnlyAgent

    agent = agents.DigitTaskAgent(task="reverse", seed=11, env_id="e", parallel_generation_tasks=2)
    assert isinstance(agent, RewardOnlyAgent) and agent.parallel_generation_tasks == 2
    prompt, record = asyncio.run(agent.get_prompt())
    assert record["prompt"] == prompt and record["answer"] == prompt[:-1][::-1]
    assert asyncio.run(agent.get_reward(record["answer"] + "<eod>", record)) == 1.0
    assert [p for p, _ in asyncio.run(agent.evaluation_prompts(3, validation=True))] == \
        [agents.nth_prompt("reverse", 11, i, validation=True) for i in range(3)]


def test_tokenizer_folder(tmp_path):
    """The written folder loads with AutoTokenizer: one id per character in the expected order, specials
    UNK/PAD/EOD at 0/1/2 (PAD non-zero, as Megatron-LM's RL requires), no BOS, decode concatenates."""
    transformers = pytest.importorskip("transformers")
    write_tokenizer(tmp_path / "tok")
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    expected = {"<unk>": 0, "<pad>": 1, "<eod>": 2, **{c: 3 + i for i, c in enumerate("0123456789+=")}}
    assert tok.get_vocab() == expected and len(tok) == 15
    assert (tok.unk_token_id, tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2, None)
    for text in ("83514=", "07+45=", "0"):
        ids = tok(text).input_ids
        assert ids == [expected[c] for c in text]
        assert tok.decode(ids) == text
        assert tok.decode(ids + [2]) == text + "<eod>"
    assert tok("1x2").input_ids == [4, 0, 5]


def test_write_tokenizer_command(tmp_path, capsys):
    """`mindspeed-proxy write-tokenizer DIR` writes the folder; a file in the way is one error line, exit 2."""
    pytest.importorskip("transformers")
    assert cli_main(["write-tokenizer", str(tmp_path / "t"), "--alphabet", "ab"]) == 0
    assert json.loads((tmp_path / "t" / "tokenizer.json").read_text())["model"]["vocab"] == \
        {"<unk>": 0, "<pad>": 1, "<eod>": 2, "a": 3, "b": 4}
    (tmp_path / "file").write_text("x")
    capsys.readouterr()
    assert cli_main(["write-tokenizer", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mindspeed-proxy write-tokenizer: error: {tmp_path / 'file'} exists and is not a directory"]
