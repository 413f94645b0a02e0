"""The fault matrix's runs: healthy warm-up of the original, conversion to a proxy, one fine-tuning run per
(fault, model), each launched with torchrun as its own process tree and measured (CPU seconds from
`os.wait4`'s rusage of that tree, wall seconds).

Every setting comes from one YAML file (examples/configs/fault_matrix.yaml): trainer flags, the two
models, warm-up and run lengths, fault specs, the monitor config, the divergence rule, per-mode overrides.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

MODELS = ("original", "proxy")


def load_config(path, mode: str = "quick") -> dict:
    """The experiment YAML (checked against experiments.config.FaultMatrix) with `modes[mode]` merged over it;
    relative paths resolved against the file."""
    from mindspeed_proxy.experiments.config import FaultMatrix, read_typed

    path = Path(path).resolve()
    cfg = read_typed(path, FaultMatrix)
    overrides = (cfg.get("modes") or {}).get(mode)
    if overrides is None:
        raise ValueError(f"{path}: no mode {mode!r} (known: {sorted(cfg.get('modes') or {})})")
    cfg = {**copy.deepcopy(cfg), **copy.deepcopy(overrides)}
    cfg["mode"], cfg["config_path"] = mode, str(path)
    cfg["monitor_config"] = str((path.parent / cfg["monitor_config"]).resolve())
    cfg["env"] = {str(k): str(v) for k, v in (cfg.get("env") or {}).items()}
    unknown = set(cfg["expected_families"]) ^ set(cfg["faults"])
    if unknown:
        raise ValueError(f"{path}: faults and expected_families name different faults: {sorted(unknown)}")
    return cfg


def fault_onset(spec: str | None) -> int | None:
    """The `start` step of a fault spec string, None for the healthy run."""
    if not spec:
        return None
    from mindspeed_proxy.faults.spec import parse_fault

    return parse_fault(spec)["start"]


@dataclass
class RunResult:
    """One finished training process tree."""

    name: str
    model: str
    fault: str
    spec: str | None
    run_dir: str
    ranks: int
    iters: int
    returncode: int
    cpu_s: float | None  # user + system CPU seconds of torchrun and all its ranks (None: not recorded)
    wall_s: float | None
    command: list = field(default_factory=list)
    branched_from: str | None = None  # the run whose checkpoint of step `branch_step` this run continued
    branch_step: int | None = None

    def to_dict(self) -> dict:
        """Plain dict for JSON (the branch fields only for a branch, so other records read as before them)."""
        out = dict(vars(self))
        if self.branched_from is None:
            del out["branched_from"], out["branch_step"]
        return out


class Progress:
    """Timestamped progress lines on stdout (thread-safe)."""

    def __init__(self, quiet: bool = False):
        self.t0, self.quiet, self._lock = time.time(), quiet, threading.Lock()

    def __call__(self, message: str) -> None:
        """Print one line prefixed with the elapsed seconds."""
        if not self.quiet:
            with self._lock:
                print(f"[{time.time() - self.t0:6.0f}s] {message}", flush=True)


def cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs since boot from /proc/stat ((0, 0) where there is none)."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_fraction(start: tuple[int, int], end: tuple[int, int]) -> float | None:
    """Share of CPU time the hypervisor gave to other guests between two cpu_times() readings."""
    total = end[1] - start[1]
    return (end[0] - start[0]) / total if total > 0 else None


TIMED_OUT = 124  # the return code of a command killed at its timeout (as timeout(1) reports it)


def launch(cmd: list[str], log_path: Path, env: dict | None = None, timeout: float | None = None,
           cwd=None) -> tuple[int, float, float]:
    """Run `cmd` (in `cwd`) with output to `log_path`; (return code, CPU seconds of its process tree, wall seconds).
    Past `timeout` seconds its whole process group is killed, a line saying so ends the log and the code is
    TIMED_OUT."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0, fired = time.time(), []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=timeout is not None,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        timer = None
        if timeout is not None:
            def kill():
                fired.append(True)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)

            timer = threading.Timer(timeout, kill)
            timer.start()
        _, status, usage = os.wait4(proc.pid, 0)  # rusage of the child incl. its waited-for ranks
        if timer is not None:
            timer.cancel()
        proc.returncode = TIMED_OUT if fired else os.waitstatus_to_exitcode(status)
        if fired:
            log.seek(0, os.SEEK_END)
            log.write(f"\nTimeoutError: no exit after {timeout:.0f} s; every process of the run killed\n")
    return proc.returncode, usage.ru_utime + usage.ru_stime, time.time() - t0


def torchrun(nproc: int, script: str, args: list[str]) -> list[str]:
    """A torchrun command line (`--standalone`: its agent binds the store itself, on a port the OS picks),
    through our launcher (`-m mindspeed_proxy.run SCRIPT`)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--standalone", "-m", "mindspeed_proxy.run", script, *args]


SETTINGS_FILE = "settings.sha256"
NUMERIC_KEYS = ("train_args", "original", "proxy", "warmup", "run", "faults", "env")


def settings_fingerprint(cfg: dict) -> str:
    """SHA-256 of every setting that decides the runs' numbers: trainer flags, models, warm-up and run
    lengths, fault specs, the pinned environment and the monitor config file's bytes."""
    numeric = {k: cfg.get(k) for k in NUMERIC_KEYS}
    monitor = cfg.get("monitor_config")
    numeric["monitor_config"] = (hashlib.sha256(Path(monitor).read_bytes()).hexdigest()
                                 if monitor and Path(monitor).is_file() else monitor)
    return hashlib.sha256(json.dumps(numeric, sort_keys=True, default=str).encode()).hexdigest()


class Matrix:
    """Builds and runs the experiment described by a loaded config under `work_dir`. With `reuse`, the
    warm-up, the finished runs and E4 results found there are reused only if the work dir records the same
    settings (`settings_fingerprint`); otherwise its earlier results are removed and everything runs."""

    def __init__(self, cfg: dict, work_dir, root, progress: Progress | None = None, reuse: bool = False):
        self.cfg, self.work, self.root = cfg, Path(work_dir).resolve(), Path(root).resolve()
        self.progress = progress or Progress()
        self.reuse = reuse
        self.trainer = str(self.root / "examples" / "train_moe.py")
        self.warm_ckpt = self.work / "warmup" / "ckpt"
        self.proxy_ckpt = self.work / "proxy_ckpt"
        self.env = cfg.get("env") or {}  # pinned threads and kernel code paths of every launched process
        self.warmup_result: RunResult | None = None
        self.convert_info: dict = {}
        self._check_settings()

    def _check_settings(self) -> None:
        import shutil

        marker, fingerprint = self.work / SETTINGS_FILE, settings_fingerprint(self.cfg)
        recorded = marker.read_text().strip() if marker.is_file() else None
        if recorded != fingerprint:
            if self.reuse:
                self.progress(f"--reuse: {self.work} holds results of other settings (or unrecorded ones): "
                              "running everything again")
            self.reuse = False
            for stale in (self.work / "runs", self.warm_ckpt.parent, self.work / "e4"):
                shutil.rmtree(stale, ignore_errors=True)
        self.work.mkdir(parents=True, exist_ok=True)
        marker.write_text(fingerprint + "\n")

    # ------------------------------------------------------------------ stages
    def model_args(self, model: str) -> list[str]:
        """Trainer flags of `model` (common flags + its expert count and EP size)."""
        m = self.cfg[model]
        return [*self.cfg["train_args"], "--num-experts", str(m["num_experts"]),
                "--expert-model-parallel-size", str(m["expert_parallel"])]

    def warmup(self) -> RunResult | None:
        """Healthy warm-up of the original, saved as a legacy checkpoint (skipped when --reuse finds it)."""
        w, o = self.cfg["warmup"], self.cfg["original"]
        if self.reuse and (self.warm_ckpt / "latest_checkpointed_iteration.txt").is_file():
            self.progress(f"warm-up: reusing {self.warm_ckpt}")
            return None
        import shutil

        shutil.rmtree(self.warm_ckpt.parent, ignore_errors=True)
        args = [*self.model_args("original"), "--train-iters", str(w["iters"]), "--save", str(self.warm_ckpt),
                "--save-interval", str(w["iters"]), "--log-dir", str(self.warm_ckpt.parent / "logs"),
                "--log-interval", "50", *w.get("args", [])]
        self.progress(f"warm-up: original ({o['num_experts']} experts, EP={o['expert_parallel']}, "
                      f"{o['ranks']} ranks), {w['iters']} healthy steps ...")
        cmd = torchrun(o["ranks"], self.trainer, args)
        rc, cpu, wall = launch(cmd, self.warm_ckpt.parent / "train.log", self.env)
        if rc:
            raise RuntimeError(f"warm-up failed (rc {rc}); see {self.warm_ckpt.parent / 'train.log'}")
        self.warmup_result = RunResult("warmup", "original", "none", None, str(self.warm_ckpt.parent / "logs"),
                                       o["ranks"], w["iters"], rc, cpu, wall, cmd)
        last = _last_step(self.warm_ckpt.parent / "logs")
        self.progress(f"warm-up done in {wall:.0f}s: final loss {last.get('loss', float('nan')):.3f}")
        return self.warmup_result

    def convert(self) -> dict:
        """`convert_to_proxy.py` of the warm-up checkpoint to the proxy's expert count at its EP size."""
        p = self.cfg["proxy"]
        cmd = [sys.executable, str(self.root / "convert_to_proxy.py"), "--load", str(self.warm_ckpt), "--save",
               str(self.proxy_ckpt), "--target-expert-parallel-size", str(p["expert_parallel"]),
               "--target-num-experts", str(p["num_experts"]), "--overwrite", *p.get("convert_args", [])]
        self.progress(f"convert: {self.cfg['original']['num_experts']} -> {p['num_experts']} experts, "
                      f"EP {self.cfg['original']['expert_parallel']} -> {p['expert_parallel']} ...")
        rc, cpu, wall = launch(cmd, self.work / "convert.log", self.env)
        if rc:
            raise RuntimeError(f"convert_to_proxy.py failed (rc {rc}); see {self.work / 'convert.log'}")
        manifest = json.loads((self.proxy_ckpt / "proxy_manifest.json").read_text())
        kept = [layer["kept_global_ids_in_new_order"] for layer in manifest["layers"]]
        self.convert_info = {"command": shlex.join(cmd), "kept": kept, "cpu_s": cpu, "wall_s": wall}
        self.progress(f"convert done in {wall:.0f}s: kept experts per layer {kept}")
        return self.convert_info

    def branch_ckpt(self, name: str) -> Path:
        """Where run `name` saves the checkpoint that a branch of it continues."""
        return self.work / "branch" / name

    def branch_points(self, pairs: list[tuple[str, str]]) -> dict:
        """{(model, "none"): ((model, fault), step)} for each model whose healthy run and a faulted run are both in
        `pairs`: the healthy run can continue the faulted run's checkpoint of a step before the fault's onset (the
        same flags but --inject-fault, whose fault changes nothing before its start; the latest onset), the last
        one at which the monitor resumes exactly: a multiple of its spectral and router intervals (docs/monitor.md,
        "State in the checkpoint")."""
        from mindspeed_proxy.monitor.config import MonitorConfig

        mc = MonitorConfig.from_file(self.cfg["monitor_config"])
        grid = math.lcm(mc.interval, mc.router_interval)
        out = {}
        for model in MODELS:
            onsets = {f: fault_onset(self.cfg["faults"][f]) or 0 for m, f in pairs if m == model}
            faulted = [f for f in onsets if f != "none" and onsets[f] > grid]
            if "none" in onsets and faulted:
                fault = max(faulted, key=lambda f: onsets[f])
                out[(model, "none")] = ((model, fault), (onsets[fault] - 1) // grid * grid)
        return out

    def run_one(self, model: str, fault: str, save_at: int | None = None,
                branch: tuple[str, int] | None = None) -> RunResult:
        """One fine-tuning run of `model` from the warm-up (or its proxy) with `fault` injected; `save_at`: also
        save its checkpoint of that step for a branch; `branch` = (run name, step): continue that run's checkpoint
        of that step instead (optimizer, RNG and monitor state too), running only the later steps."""
        m, r = self.cfg[model], self.cfg["run"]
        spec = self.cfg["faults"][fault]
        name = f"{model}_{fault}"
        run_dir = self.work / "runs" / name
        done = self.work / "runs" / f"{name}.result.json"
        if self.reuse and done.is_file():
            res = RunResult(**json.loads(done.read_text()))
            saved = save_at is None or (self.branch_ckpt(name) / "latest_checkpointed_iteration.txt").is_file()
            if res.spec == spec and res.iters == r["iters"] and saved and (res.branched_from is None or branch):
                self.progress(f"run {name}: reusing {run_dir}")
                return res
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
        common = ["--train-iters", str(r["iters"]), "--log-dir", str(run_dir), "--log-interval", "1000000",
                  "--enable-mechanism-monitor", "--mechanism-monitor-config", self.cfg["monitor_config"],
                  *r.get("args", [])]
        if branch is not None:
            args = [*self.model_args(model), "--load", str(self.branch_ckpt(branch[0])), "--ckpt-step",
                    str(branch[1]), *common]
        else:
            ckpt = self.warm_ckpt if model == "original" else self.proxy_ckpt
            args = [*self.model_args(model), "--load", str(ckpt), "--finetune", "--no-load-optim", "--no-load-rng",
                    *common]
        if save_at is not None:
            shutil.rmtree(self.branch_ckpt(name), ignore_errors=True)
            args += ["--save", str(self.branch_ckpt(name)), "--save-interval", str(save_at)]
        if spec:
            args += ["--inject-fault", spec]
        cmd = torchrun(m["ranks"], self.trainer, args)
        since = f", continuing {branch[0]} after step {branch[1]}" if branch else ""
        self.progress(f"run {name}: {m['ranks']} rank(s), {r['iters']} steps, fault {spec or 'none'}{since} ...")
        rc, cpu, wall = launch(cmd, run_dir / "train.log", self.env)
        res = RunResult(name, model, fault, spec, str(run_dir), m["ranks"], r["iters"], rc, cpu, wall, cmd,
                        *(branch or (None, None)))
        if rc:
            raise RuntimeError(f"run {name} failed (rc {rc}); see {run_dir / 'train.log'}")
        done.write_text(json.dumps(res.to_dict()))
        n_alerts = sum(1 for line in open(run_dir / "mechanism_monitor" / "monitor.jsonl")
                       if '"type": "alert"' in line)
        self.progress(f"run {name} done in {wall:.0f}s ({cpu:.0f} CPU-s): {n_alerts} alert(s), final loss "
                      f"{_last_step(run_dir).get('loss', float('nan')):.3f}")
        return res

    def run_grid(self, pairs: list[tuple[str, str]], slots: int = 1, branch: bool = False) -> list[RunResult]:
        """Run every (model, fault) pair, in order, as many at once as fit in `slots` cores (a run takes one
        core per rank, one rank per core); results in the order of `pairs`. `branch`: each healthy run starts
        after a faulted run of its model has finished and continues its checkpoint of a step before the onset
        (`branch_points`), instead of running from step 0."""
        plan = self.branch_points(pairs) if branch else {}
        sources = {src: step for src, step in plan.values()}
        finished = {src: threading.Event() for src in sources}
        order = [p for p in pairs if p not in plan]
        for healthy, (src, _) in plan.items():
            order.insert(order.index(src) + 1, healthy)

        def job(pair):
            if pair in plan:
                src, step = plan[pair]
                finished[src].wait()
                return self.run_one(*pair, branch=(f"{src[0]}_{src[1]}", step))
            try:
                return self.run_one(*pair, **({"save_at": sources[pair]} if pair in sources else {}))
            finally:
                if pair in finished:
                    finished[pair].set()

        done = run_in_slots([lambda p=p: job(p) for p in order], [min(self.cfg[m]["ranks"], slots) for m, _ in order],
                            slots)
        return [done[order.index(p)] for p in pairs]


def run_in_slots(jobs: list, needs: list[int], slots: int) -> list:
    """Call every job, first come first served, as many at once as their `needs` (cores) fit in `slots`;
    results in the order of `jobs`."""
    if slots <= 1:
        return [job() for job in jobs]
    turn, free, cond = [0], [slots], threading.Condition()

    def one(index):
        need = min(needs[index], slots)
        with cond:  # a job waits for its turn, then for its cores
            cond.wait_for(lambda: turn[0] == index and free[0] >= need)
            turn[0], free[0] = turn[0] + 1, free[0] - need
            cond.notify_all()
        try:
            return jobs[index]()
        finally:
            with cond:
                free[0] += need
                cond.notify_all()

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, range(len(jobs))))


def _last_step(log_dir) -> dict:
    """The last step record of a run's metrics.jsonl ({} when none)."""
    path = Path(log_dir) / "metrics.jsonl"
    last = {}
    if path.is_file():
        for line in open(path):
            if '"type": "step"' in line:
                last = json.loads(line)
    return last
