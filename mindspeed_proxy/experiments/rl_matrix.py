"""The RL fault matrix's runs for one seed: SFT + GRPO warm-up of the original, conversion to proxies (clustered,
random, most-used), one GRPO run per (fault, model) and the R3 controls, each its own process tree (CPU seconds
from `os.wait4`). A seed sets `--seed` of every process (SFT initialisation, prompts, sampling, conversion).

Every finished stage writes `<stage>.done.json` (its result and the hash of its command); with `reuse` a stage
whose record holds the same hash is skipped, and a stage without a record (killed half-way) runs again.
Settings: examples/configs/rl_fault_matrix.yaml.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Optional

from mindspeed_proxy.determinism import PINNED_ENV
from mindspeed_proxy.experiments.matrix import Progress, RunResult, launch, run_in_slots

MODELS = ("original", "proxy")
SELECTIONS = ("cluster", "random", "usage")  # convert_to_proxy.py --selection
SEED_LISTS = ("tuning_seeds", "heldout_seeds")
LOOPS = ("grpo", "train_rl")  # mindspeed_proxy.rl.train, Megatron-LM's train_rl.py (experiments/megatron_rl_matrix.py)


def load_rl_config(path) -> dict:
    """The RL matrix YAML (checked against experiments.config.RLFaultMatrix), with each fault spec's {onset}
    filled in (ValueError names a bad entry)."""
    from mindspeed_proxy.experiments.config import MegatronLoop, RLFaultMatrix, read_typed

    path = Path(path).resolve()
    cfg = read_typed(path, RLFaultMatrix)
    with_defaults(cfg, RLFaultMatrix)
    if cfg["megatron"] is not None:
        with_defaults(cfg["megatron"], MegatronLoop)
    cfg["faults"] = {k: (v.format(onset=cfg["onset"]) if v else None) for k, v in cfg["faults"].items()}
    bad = [f for f in cfg["r3_controls"] if f not in cfg["faults"]]
    if bad:
        raise ValueError(f"{path}: r3_controls name unknown faults {bad}")
    if "--seed" in cfg["task_args"]:
        raise ValueError(f"{path}: task_args must not set --seed (the matrix sets it per seed)")
    missing = [f for f in cfg["faults"] if f != "none" and f not in cfg.get("expected_families", {})]
    if missing:
        raise ValueError(f"{path}: expected_families lacks faults {missing}")
    for key in SEED_LISTS:
        if not cfg.get(key) or not all(isinstance(s, int) for s in cfg[key]):
            raise ValueError(f"{path}: {key} must be a non-empty list of integers")
    if set(cfg["tuning_seeds"]) & set(cfg["heldout_seeds"]):
        raise ValueError(f"{path}: tuning_seeds and heldout_seeds overlap")
    if cfg["loop"] not in LOOPS:
        raise ValueError(f"{path}: loop {cfg['loop']!r}: expected one of {', '.join(LOOPS)}")
    if cfg["loop"] == "train_rl" and cfg["megatron"] is None:
        raise ValueError(f"{path}: loop train_rl needs the 'megatron' settings (arch_args, sft_args, rl_args, ...)")
    cfg["healthy_rl_seeds"] = healthy_rl_seeds(path, cfg)
    cfg["config_path"] = str(path)
    return cfg


def with_defaults(mapping: dict, schema) -> dict:
    """`mapping` (a checked YAML mapping) with the dataclass `schema`'s defaults for the keys it leaves out."""
    for f in dataclasses.fields(schema):
        if f.name not in mapping and f.default is not dataclasses.MISSING:
            mapping[f.name] = f.default
        elif f.name not in mapping and f.default_factory is not dataclasses.MISSING:
            mapping[f.name] = f.default_factory()
    return mapping


def healthy_rl_seeds(path, cfg) -> dict[int, list[int]]:
    """{warm-up seed: [RL seeds of its extra healthy runs]}, checked: every key a tuning or held-out seed, every
    RL seed used once and none equal to a warm-up seed (ValueError names the bad entry)."""
    out, used = {}, set()
    warm = {*cfg["tuning_seeds"], *cfg["heldout_seeds"]}
    for key, rl_seeds in cfg.get("healthy_rl_seeds", {}).items():
        try:
            seed = int(key)
        except ValueError:
            raise ValueError(f"{path}: healthy_rl_seeds key {key!r} is not an integer seed") from None
        if seed not in warm:
            raise ValueError(f"{path}: healthy_rl_seeds key {seed} is neither a tuning nor a held-out seed")
        bad = [s for s in rl_seeds if s in warm or s in used or rl_seeds.count(s) > 1]
        if bad:
            raise ValueError(f"{path}: healthy_rl_seeds[{seed}] reuses seeds {bad} (RL seeds must be distinct "
                             "from each other and from every warm-up seed)")
        used.update(rl_seeds)
        out[seed] = list(rl_seeds)
    return out


def command(ranks: int, module: str, args: list[str]) -> list[str]:
    """`python -m module args` on 1 rank, under torchrun `--standalone` on more."""
    if ranks == 1:
        return [sys.executable, "-m", module, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
            "--standalone", "-m", module, *args]


def command_hash(cmd: list[str]) -> str:
    """SHA-256 of a command without its interpreter and master port, plus the bytes of every file it names
    that is a YAML config, so that an edited monitor config is a different run (outputs are not hashed)."""
    parts, skip = [], False
    for i, arg in enumerate(cmd):
        if skip or i == 0:
            skip = False
            continue
        if arg == "--master-port":
            skip = True
            continue
        parts.append(arg)
        if arg.endswith((".yaml", ".yml")) and Path(arg).is_file():
            parts.append(hashlib.sha256(Path(arg).read_bytes()).hexdigest())
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def planned_names(cfg: dict, seed: int, faults) -> list[str]:
    """The names of the runs seed `seed` makes with `faults` (tuning or held-out, extra healthy runs included)."""
    extra = [f"{m}_none_s{rl}" for m in MODELS for rl in cfg["healthy_rl_seeds"].get(seed, [])]
    if seed in cfg["tuning_seeds"]:
        return [f"{m}_none" for m in MODELS] + extra
    return extra + [f"{m}_{f}{r}" for m in MODELS for f in faults
                    for r in ("", "_r3") if not r or f in cfg["r3_controls"]]


class RLMatrix:
    """Builds and runs the RL experiment of a loaded config for one seed under `work_dir`."""

    def __init__(self, cfg: dict, work_dir, root, progress: Progress | None = None, seed: int = 1,
                 reuse: bool = False):
        self.cfg, self.work, self.root = cfg, Path(work_dir).resolve(), Path(root).resolve()
        self.progress, self.seed, self.reuse = progress or Progress(), seed, reuse
        self.sft = self.work / "sft"
        self.warm = self.work / "warmup"
        self.usage = self.work / "warmup_usage.json"
        self.results: list[RunResult] = []

    def proxy_ckpt(self, selection: str = "cluster") -> Path:
        """Where the proxy of `selection` is written."""
        return self.work / f"proxy_{selection}"

    def task_args(self, seed: Optional[int] = None) -> list[str]:
        """The task flags with this matrix's seed (or `seed`)."""
        return [*self.cfg["task_args"], "--seed", str(self.seed if seed is None else seed)]

    def model_args(self, model: str, selection: str = "cluster", seed: Optional[int] = None) -> list[str]:
        """Task, model and load flags of `model` (the original's warm-up or a proxy of it)."""
        m = self.cfg[model]
        ckpt = self.warm if model == "original" else self.proxy_ckpt(selection)
        return [*self.task_args(seed), "--num-experts", str(m["num_experts"]),
                "--expert-model-parallel-size", str(m["expert_parallel"]), "--load", str(ckpt)]

    def _stage(self, name: str, model: str, fault: str, spec, ranks: int, cmd: list[str], iters: int,
               run_dir: Path, log: Path, outputs=(), check: bool = True, env: Optional[dict] = None,
               timeout: Optional[float] = None, after=None) -> RunResult:
        """Run `cmd` unless `reuse` finds its completed record; write the record when it ends (`env`: added to
        the pinned environment; `timeout`: seconds before the process tree is killed; `after(run_dir)`: called
        once the command has ended, before the record is written)."""
        record, digest = Path(str(run_dir) + ".done.json"), command_hash(cmd)
        if self.reuse and record.is_file():
            saved = json.loads(record.read_text())
            if saved.get("hash") in (digest, "imported"):  # imported: a run kept in the repo (rl_results.import_raw)
                self.progress(f"[seed {self.seed}] {name}: reusing {run_dir}")
                return RunResult(**saved["result"])
        record.unlink(missing_ok=True)
        for path in (run_dir, *outputs):  # a half-written earlier attempt
            shutil.rmtree(path, ignore_errors=True)
        # pinned numerics, as the RL demo (docs/determinism.md)
        rc, cpu, wall = launch(cmd, log, {**PINNED_ENV, **(env or {})}, timeout=timeout)
        if after is not None:
            after(run_dir)
        result = RunResult(name, model, fault, spec, str(run_dir), ranks, iters, rc, cpu, wall, cmd)
        if rc and check:
            raise RuntimeError(f"seed {self.seed} {name}: exit {rc}; see {log}")
        record.write_text(json.dumps({"hash": digest, "seed": self.seed, "result": result.to_dict()}, default=str))
        self.progress(f"[seed {self.seed}] {name}: {wall:.0f} s wall, {cpu:.0f} CPU s"
                      + (f", exit {rc}" if rc else ""))
        return result

    def _launch(self, name, model, fault, spec, ranks, module, args, iters, run_dir, outputs=(), check=True):
        return self._stage(name, model, fault, spec, ranks, command(ranks, module, args), iters, run_dir,
                           Path(run_dir) / "run.log", outputs, check)

    def warmup(self) -> None:
        """SFT, then GRPO warm-up from it (saved with its expert usage) on the original's layout."""
        c, ranks = self.cfg, self.cfg["original"]["ranks"]
        m = ["--num-experts", str(c["original"]["num_experts"]), "--expert-model-parallel-size",
             str(c["original"]["expert_parallel"])]
        self.results.append(self._launch(
            "sft", "original", "none", None, ranks, "mindspeed_proxy.rl.sft",
            [*self.task_args(), *m, "--train-iters", str(c["sft_iters"]), "--log-interval", "50",
             "--save", str(self.sft), "--log-dir", str(self.work / "sft_logs")],
            c["sft_iters"], self.work / "sft_logs", outputs=(self.sft,)))
        self.results.append(self._launch(
            "warmup", "original", "none", None, ranks, "mindspeed_proxy.rl.train",
            [*self.task_args(), *m, *c["grpo_args"], "--load", str(self.sft), "--train-iters",
             str(c["warmup_rl_iters"]), "--save", str(self.warm), "--rl-save-expert-usage", str(self.usage),
             "--rl-eval-prompts", "0", "--log-dir", str(self.work / "warmup_logs")],
            c["warmup_rl_iters"], self.work / "warmup_logs", outputs=(self.warm,)))

    def convert(self, selections=("cluster",)) -> None:
        """convert_to_proxy.py of the warm-up for each of `selections` (cluster: the matrix's proxy)."""
        k = str(self.cfg["proxy"]["num_experts"])
        for selection in selections:
            extra = {"cluster": [], "random": ["--selection", "random", "--seed", str(self.seed)],
                     "usage": ["--selection", "usage", "--usage-file", str(self.usage)]}[selection]
            out = self.proxy_ckpt(selection)
            cmd = [sys.executable, str(self.root / "convert_to_proxy.py"), "--load", str(self.warm), "--save",
                   str(out), "--target-expert-parallel-size", str(self.cfg["proxy"]["expert_parallel"]),
                   "--target-num-experts", k, *extra]
            self.results.append(self._stage(f"convert_{selection}", "proxy", "none", None, 1, cmd, 0, out,
                                            self.work / f"convert_{selection}.log"))

    def run(self, fault: str, model: str, r3: bool = False, evals: int = 0, rl_seed: Optional[int] = None) -> RunResult:
        """One GRPO run of `model` from the warm-up with `fault` (monitor on, samples recorded; R3 for a control);
        `rl_seed` replaces the seed of the run's own process (prompts, sampling), not the warm-up's."""
        c = self.cfg
        spec = c["faults"][fault]
        name = f"{model}_{fault}" + ("_r3" if r3 else "") + (f"_s{rl_seed}" if rl_seed is not None else "")
        run_dir = self.work / "runs" / name
        args = [*self.model_args(model, seed=rl_seed), *c["grpo_args"], "--train-iters", str(c["run_iters"]),
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

    def planned(self, faults) -> list[str]:
        """The names of the runs this seed makes (tuning or held-out, extra healthy runs included)."""
        return planned_names(self.cfg, self.seed, faults)

    def recorded(self, faults) -> bool:
        """Whether every planned run already has a completed record (then no warm-up is needed)."""
        return all((self.work / "runs" / f"{n}.done.json").is_file() for n in self.planned(faults))

    def tuning_runs(self, slots: int = 1) -> list[RunResult]:
        """The healthy runs of a tuning seed (original and proxy, extra RL seeds included), what `calibrate`
        reads; the proxy's first, `slots` at once (no evals: E4 reads a held-out seed)."""
        return self.heldout_runs({}, slots, evals=0)

    def heldout_runs(self, faults, slots: int = 1, evals: int | None = None) -> list[RunResult]:
        """Every (fault, model) run of a held-out seed, its extra healthy runs and the R3 controls of
        `r3_controls`: the healthy runs first (what the false-alarm rate needs), then the faulted ones; within
        each, the proxy's (one rank each, `slots` of them at once) before the original's."""
        healthy, faulted = [], []
        for model in ("proxy", "original"):
            e = self.cfg["e4_eval_prompts"] if evals is None else evals
            healthy.append((model, lambda m=model, e=e: self.run("none", m, evals=e)))
            healthy += [(model, lambda m=model, s=rl: self.run("none", m, rl_seed=s))
                        for rl in self.cfg["healthy_rl_seeds"].get(self.seed, [])]
            for fault in [f for f in faults if f != "none"]:
                faulted.append((model, lambda f=fault, m=model: self.run(f, m)))
                if fault in self.cfg["r3_controls"]:
                    faulted.append((model, lambda f=fault, m=model: self.run(f, m, r3=True)))
        jobs = healthy + faulted
        return run_in_slots([job for _, job in jobs], [self.cfg[m]["ranks"] for m, _ in jobs], slots)

    def e4(self) -> dict:
        """Held-out eval reward right after conversion and after `run_iters` healthy steps: the original and the
        clustered proxy from their healthy matrix runs, the random and most-used proxies from runs of their own."""
        c, out = self.cfg, {}
        for name, run_dir in (("original", self.work / "runs" / "original_none"),
                              ("cluster", self.work / "runs" / "proxy_none")):
            out[name] = eval_pair(run_dir)
        self.convert(("random", "usage"))
        for selection in ("random", "usage"):
            run_dir = self.work / "e4" / selection
            args = [*self.model_args("proxy", selection), *c["grpo_args"], "--train-iters", str(c["run_iters"]),
                    "--rl-eval-prompts", str(c["e4_eval_prompts"]), "--log-dir", str(run_dir)]
            self.results.append(self._launch(f"e4_{selection}", "proxy", "none", None, 1, "mindspeed_proxy.rl.train",
                                             args, c["run_iters"], run_dir))
            out[selection] = eval_pair(run_dir)
        return out


def eval_pair(run_dir) -> dict:
    """The eval reward before the first and after the last step of a run."""
    evals = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if r.get("type") == "eval"]
    return {"before": evals[0]["eval_reward"], "after": evals[-1]["eval_reward"]}


def read_jsonl(path) -> list[dict]:
    """Every JSON record of a .jsonl file (.gz read as gzip)."""
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
