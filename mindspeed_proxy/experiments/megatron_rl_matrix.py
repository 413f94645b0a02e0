"""The RL fault matrix in Megatron-LM's own `train_rl.py`: per seed an SFT start checkpoint made with Megatron-LM's
tools (`preprocess_data.py`, `pretrain_gpt.py`), its proxy (`convert_to_proxy.py`), then one `train_rl.py` run per
(fault, model) under `torchrun -m mindspeed_proxy.run` with the monitor recording its samples.

The runs land where the GRPO matrix's do (`runs/<name>/metrics.jsonl`, `runs/<name>/mechanism_monitor/`), so the
same calibration, replay, tables and page (rl_results.py, rl_page.py) read them: each run's `metrics.jsonl` is
written from the rollouts Megatron-LM pickles (`LANGRL_LOG_DIR`), one step record per train_rl.py iteration with
its mean reward. Settings: examples/configs/megatron_rl_fault_matrix.yaml.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

from mindspeed_proxy.experiments.matrix import Progress, RunResult, torchrun
from mindspeed_proxy.experiments.rl_matrix import RLMatrix


def sft_text(prompt: str, answer: str, seq: int) -> str:
    """One SFT document of exactly `seq` tokens: prompt, answer, EOD, then PAD. Megatron-LM's GPTDataset cuts the
    packed documents into `seq`-token samples, so each sample is one document starting at position 0, as a
    rollout does."""
    from mindspeed_proxy.rl.tokenizer_dir import EOD, PAD

    pad = seq - len(prompt) - len(answer) - 1
    if pad < 0:
        raise ValueError(f"{prompt!r} + {answer!r} + EOD is longer than {seq} tokens")
    return prompt + answer + EOD + PAD * pad


def write_sft_jsonl(path, task_name: str, data_seed: int, docs: int, seq: int) -> None:
    """`docs` digit-task documents of prompt stream `data_seed` as Megatron-LM's preprocess_data.py input."""
    from mindspeed_proxy.rl.megatron_agents import nth_prompt
    from mindspeed_proxy.rl.tasks import build_task

    task = build_task(task_name)
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(docs):
            prompt = nth_prompt(task_name, data_seed, i)
            fh.write(json.dumps({"text": sft_text(prompt, task.answer(prompt), seq)}) + "\n")


def rollout_metrics(run_dir, langrl) -> int:
    """Write `run_dir/metrics.jsonl` (a step record per iteration: its rollouts' mean reward) from the pickles in
    `langrl` (the run's LANGRL_LOG_DIR), then remove that folder; the number of steps written."""
    from mindspeed_proxy.experiments.megatron_rl_faults import rollout_rewards

    langrl = Path(langrl)
    rewards = rollout_rewards(langrl) if langrl.is_dir() else {}
    with open(Path(run_dir) / "metrics.jsonl", "w", encoding="utf-8") as fh:
        for step, reward in sorted(rewards.items()):
            fh.write(json.dumps({"type": "step", "iteration": step, "reward_mean": reward}) + "\n")
    shutil.rmtree(langrl, ignore_errors=True)
    return len(rewards)


class MegatronRLMatrix(RLMatrix):
    """RLMatrix whose stages are Megatron-LM's: the SFT is `pretrain_gpt.py` (no GRPO warm-up: the runs start from
    the SFT checkpoint, which is also what the proxy is converted from), the runs are `train_rl.py`."""

    def __init__(self, cfg: dict, work_dir, root, megatron_lm, progress: Progress | None = None, seed: int = 1,
                 reuse: bool = False):
        super().__init__(cfg, work_dir, root, progress, seed, reuse)
        self.mlm = Path(megatron_lm).resolve()
        self.m = cfg["megatron"]
        self.warm = self.sft  # what the original's runs load and the converter reads
        self.tokenizer = self.work / "tokenizer"

    def env(self) -> dict:
        """Added to the pinned environment of every stage: the checkout first on PYTHONPATH, the interpreter's folders
        first on PATH (Megatron-LM's dataset helper builds with whatever `python3-config` is there)."""
        path = [os.path.dirname(sys.executable), os.path.join(sys.base_prefix, "bin"), os.environ.get("PATH", "")]
        return {"PATH": os.pathsep.join(path),
                "PYTHONPATH": os.pathsep.join(p for p in [str(self.mlm), os.environ.get("PYTHONPATH", "")] if p)}

    def warmup(self) -> None:
        """The tokenizer folder, the SFT documents through preprocess_data.py, then pretrain_gpt.py SFT on the
        original's layout (its checkpoint: legacy torch format, what train_rl.py's --finetune loads)."""
        from mindspeed_proxy.rl.tokenizer_dir import write_tokenizer

        c, m, o = self.cfg, self.m, self.cfg["original"]
        self.work.mkdir(parents=True, exist_ok=True)
        write_tokenizer(str(self.tokenizer))
        data = self.work / "sft_data"
        data.mkdir(exist_ok=True)
        write_sft_jsonl(data / "sft.jsonl", m["task"], self.seed + m["sft_data_seed_offset"], m["sft_docs"],
                        m["seq_length"])
        prefix = data / "sft"
        self.results.append(self._stage(
            "preprocess", "original", "none", None, 1,
            [sys.executable, str(self.mlm / "tools" / "preprocess_data.py"), "--input", str(data / "sft.jsonl"),
             "--output-prefix", str(prefix), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
             str(self.tokenizer), "--workers", "1"],
            0, self.work / "preprocess", self.work / "preprocess.log", env=self.env()))
        flags = [*m["arch_args"], *m["sft_args"], "--tokenizer-model", str(self.tokenizer), "--num-experts",
                 str(o["num_experts"]), "--expert-model-parallel-size", str(o["expert_parallel"]), "--seed",
                 str(self.seed), "--data-path", f"{prefix}_text_document", "--train-iters", str(c["sft_iters"]),
                 "--save", str(self.sft), "--save-interval", str(c["sft_iters"])]
        self.results.append(self._stage(
            "sft", "original", "none", None, o["ranks"], torchrun(o["ranks"], str(self.mlm / "pretrain_gpt.py"), flags),
            c["sft_iters"], self.work / "sft_logs", self.work / "sft.log", outputs=(self.sft,), env=self.env()))

    def env_config(self, seed: int) -> Path:
        """The --langrl-env-config of a run with RL seed `seed` (the agent's prompt stream)."""
        import yaml

        from mindspeed_proxy.rl.megatron_agents import env_config

        path = self.work / f"digits_{seed}.yaml"
        with open(path, "w", encoding="utf-8") as fh:
            yaml.safe_dump(env_config(self.m["task"], self.m["partial_credit"], seed), fh)
        return path

    def launch_flags(self, model: str) -> tuple[int, list[str]]:
        """(ranks, layout and load flags) of `model`: the SFT checkpoint on the original's layout, or the proxy
        with the launch flags its conversion printed."""
        if model == "original":
            o = self.cfg["original"]
            return o["ranks"], ["--num-experts", str(o["num_experts"]), "--expert-model-parallel-size",
                                str(o["expert_parallel"]), "--load", str(self.sft), "--finetune", "--no-load-optim",
                                "--no-load-rng"]
        from mindspeed_proxy.proxy.printed_launch import read_launch

        log = self.work / "convert_cluster.log"
        return read_launch(log.read_text(encoding="utf-8"), str(log))

    def run(self, fault: str, model: str, r3: bool = False, evals: int = 0,
            rl_seed: Optional[int] = None) -> RunResult:
        """One train_rl.py run of `model` with `fault` (monitor on; R3 for a control); `rl_seed` replaces the seed of
        the run (train_rl.py's --seed, the agent's prompts, a rollout fault's noise), not the SFT's."""
        c = self.cfg
        seed = self.seed if rl_seed is None else rl_seed
        spec = c["faults"][fault]
        if spec and spec.startswith("rollout-router-noise") and "seed=" not in spec:
            spec = f"{spec},seed={seed}"
        name = f"{model}_{fault}" + ("_r3" if r3 else "") + (f"_s{rl_seed}" if rl_seed is not None else "")
        run_dir = self.work / "runs" / name
        ranks, layout = self.launch_flags(model)
        flags = [*self.m["arch_args"], *self.m["rl_args"], "--tokenizer-model", str(self.tokenizer), "--seed",
                 str(seed), "--train-iters", str(c["run_iters"]), "--langrl-env-config", str(self.env_config(seed)),
                 "--enable-mechanism-monitor", "--mechanism-monitor-output", str(run_dir / "mechanism_monitor")]
        if c.get("monitor_config"):
            flags += ["--mechanism-monitor-config", str(Path(c["config_path"]).parent / c["monitor_config"])]
        flags += ["--inject-fault", spec] if spec else []
        flags += ["--mechanism-routing-replay", "r3"] if r3 else []
        cmd = torchrun(ranks, str(self.mlm / "train_rl.py"), flags + layout)
        # Megatron-LM opens LANGRL_LOG_DIR/lang_rl.log at import: the folder must exist before the launch, and the
        # run dir is emptied then, so it lies beside it (removed once the rewards are read)
        langrl = self.work / "runs" / f"{name}.langrl"
        shutil.rmtree(langrl, ignore_errors=True)
        langrl.mkdir(parents=True)
        result = self._stage(name, model, fault, spec, ranks, cmd, c["run_iters"], run_dir, run_dir / "run.log",
                             check=False, env={**self.env(), "LANGRL_LOG_DIR": str(langrl)},
                             timeout=self.m["run_timeout_s"], after=lambda folder: rollout_metrics(folder, langrl))
        shutil.rmtree(langrl, ignore_errors=True)  # a reused run leaves it empty
        self.results.append(result)
        return result

    def e4(self) -> dict:
        """Not measured in this loop (train_rl.py has no held-out eval reward of ours)."""
        return {}
