"""The RL fault matrix's runs: SFT + GRPO warm-up of the original, conversion to proxies (clustered, random,
most-used), one GRPO run per (fault, model) and the R3 controls, each its own process tree (CPU seconds
from `os.wait4`). Settings: examples/configs/rl_fault_matrix.yaml.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from mindspeed_proxy.experiments.matrix import Progress, RunResult, launch
from mindspeed_proxy.testing import free_port

MODELS = ("original", "proxy")
SELECTIONS = ("cluster", "random", "usage")  # convert_to_proxy.py --selection


def load_rl_config(path) -> dict:
    """The RL matrix YAML, with each fault spec's {onset} filled in."""
    import yaml

    path = Path(path).resolve()
    cfg = yaml.safe_load(path.read_text())
    cfg["faults"] = {k: (v.format(onset=cfg["onset"]) if v else None) for k, v in cfg["faults"].items()}
    bad = [f for f in cfg["r3_controls"] if f not in cfg["faults"]]
    if bad:
        raise ValueError(f"{path}: r3_controls name unknown faults {bad}")
    cfg["config_path"] = str(path)
    return cfg


def command(ranks: int, module: str, args: list[str]) -> list[str]:
    """`python -m module args` on 1 rank, under torchrun (free port) on more."""
    if ranks == 1:
        return [sys.executable, "-m", module, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
            "--master-port", str(free_port()), "-m", module, *args]


class RLMatrix:
    """Builds and runs the RL experiment of a loaded config under `work_dir`."""

    def __init__(self, cfg: dict, work_dir, root, progress: Progress | None = None):
        self.cfg, self.work, self.root = cfg, Path(work_dir).resolve(), Path(root).resolve()
        self.progress = progress or Progress()
        self.sft = self.work / "sft"
        self.warm = self.work / "warmup"
        self.usage = self.work / "warmup_usage.json"
        self.results: list[RunResult] = []

    def proxy_ckpt(self, selection: str = "cluster") -> Path:
        """Where the proxy of `selection` is written."""
        return self.work / f"proxy_{selection}"

    def model_args(self, model: str, selection: str = "cluster") -> list[str]:
        """Task, model and load flags of `model` (the original's warm-up or a proxy of it)."""
        m = self.cfg[model]
        ckpt = self.warm if model == "original" else self.proxy_ckpt(selection)
        return [*self.cfg["task_args"], "--num-experts", str(m["num_experts"]),
                "--expert-model-parallel-size", str(m["expert_parallel"]), "--load", str(ckpt)]

    def _launch(self, name: str, model: str, fault: str, spec, ranks: int, module: str, args: list[str],
                iters: int, run_dir: Path, check: bool = True) -> RunResult:
        cmd = command(ranks, module, args)
        rc, cpu, wall = launch(cmd, run_dir / "run.log")
        result = RunResult(name, model, fault, spec, str(run_dir), ranks, iters, rc, cpu, wall, cmd)
        if rc and check:
            raise RuntimeError(f"{name}: exit {rc}; see {run_dir / 'run.log'}")
        self.progress(f"{name}: {wall:.0f} s wall, {cpu:.0f} CPU s" + (f", FAILED (exit {rc})" if rc else ""))
        return result

    def warmup(self) -> None:
        """SFT, then GRPO warm-up from it (saved with its expert usage) on the original's layout."""
        c, ranks = self.cfg, self.cfg["original"]["ranks"]
        m = ["--num-experts", str(c["original"]["num_experts"]), "--expert-model-parallel-size",
             str(c["original"]["expert_parallel"])]
        self._launch("sft", "original", "none", None, ranks, "mindspeed_proxy.rl.sft",
                     [*c["task_args"], *m, "--train-iters", str(c["sft_iters"]), "--log-interval", "50",
                      "--save", str(self.sft), "--log-dir", str(self.work / "sft_logs")],
                     c["sft_iters"], self.work / "sft_logs")
        self.results.append(self._launch(
            "warmup", "original", "none", None, ranks, "mindspeed_proxy.rl.train",
            [*c["task_args"], *m, *c["grpo_args"], "--load", str(self.sft), "--train-iters",
             str(c["warmup_rl_iters"]), "--save", str(self.warm), "--rl-save-expert-usage", str(self.usage),
             "--log-dir", str(self.work / "warmup_logs")], c["warmup_rl_iters"], self.work / "warmup_logs"))

    def convert(self) -> None:
        """convert_to_proxy.py of the warm-up: clustered (default), random and most-used selections."""
        k = str(self.cfg["proxy"]["num_experts"])
        for selection in SELECTIONS:
            extra = {"cluster": [], "random": ["--selection", "random", "--seed", "1"],
                     "usage": ["--selection", "usage", "--usage-file", str(self.usage)]}[selection]
            out = self.proxy_ckpt(selection)
            cmd = [sys.executable, str(self.root / "convert_to_proxy.py"), "--load", str(self.warm), "--save",
                   str(out), "--target-expert-parallel-size", str(self.cfg["proxy"]["expert_parallel"]),
                   "--target-num-experts", k, *extra]
            rc, _, wall = launch(cmd, self.work / f"convert_{selection}.log")
            if rc:
                raise RuntimeError(f"convert ({selection}): exit {rc}; see {self.work / f'convert_{selection}.log'}")
            self.progress(f"convert ({selection}): {wall:.0f} s")

    def run(self, fault: str, model: str, r3: bool = False) -> RunResult:
        """One GRPO run of `model` from the warm-up with `fault` (monitor on; R3 for a control run)."""
        c = self.cfg
        spec = c["faults"][fault]
        name = f"{model}_{fault}" + ("_r3" if r3 else "")
        run_dir = self.work / "runs" / name
        evals = c["e4_eval_prompts"] if fault == "none" and not r3 else 0  # the healthy runs are E4's too
        args = [*self.model_args(model), *c["grpo_args"], "--train-iters", str(c["run_iters"]),
                "--rl-eval-prompts", str(evals), "--enable-mechanism-monitor", "--log-dir", str(run_dir)]
        if c.get("monitor_config"):
            args += ["--mechanism-monitor-config", str(Path(c["config_path"]).parent / c["monitor_config"])]
        if spec:
            args += ["--inject-fault", spec]
        if r3:
            args += ["--rl-routing-replay", "r3"]
        result = self._launch(name, model, fault, spec, c[model]["ranks"], "mindspeed_proxy.rl.train", args,
                              c["run_iters"], run_dir, check=False)  # a run the fault crashes is a result too
        self.results.append(result)
        return result

    def e4(self) -> dict:
        """Held-out eval reward right after conversion and after `run_iters` healthy steps: the original and the
        clustered proxy from their healthy matrix runs, the random and most-used proxies from runs of their own."""
        c, out = self.cfg, {}
        for name, run_dir in (("original", self.work / "runs" / "original_none"),
                              ("cluster", self.work / "runs" / "proxy_none")):
            out[name] = eval_pair(run_dir)
        for selection in ("random", "usage"):
            run_dir = self.work / "e4" / selection
            args = [*self.model_args("proxy", selection), *c["grpo_args"], "--train-iters", str(c["run_iters"]),
                    "--rl-eval-prompts", str(c["e4_eval_prompts"]), "--log-dir", str(run_dir)]
            self._launch(f"e4_{selection}", "proxy", "none", None, 1, "mindspeed_proxy.rl.train", args,
                         c["run_iters"], run_dir)
            out[selection] = eval_pair(run_dir)
        return out


def eval_pair(run_dir) -> dict:
    """The eval reward before the first and after the last step of a run."""
    evals = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if r.get("type") == "eval"]
    return {"before": evals[0]["eval_reward"], "after": evals[-1]["eval_reward"]}


def read_jsonl(path) -> list[dict]:
    """Every JSON record of a .jsonl file."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
