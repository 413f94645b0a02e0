"""`make rl-demo`: SFT, then GRPO with the reward rising, then a proxy that reproduces an RL fault (CPU, 2 cores).

1. SFT warm-up of the tiny MoE (8 experts, top-2) on the embedded digit-reversal task, 2 gloo ranks, EP=2;
2. GRPO from it with the mechanism monitor on (healthy: the reward rises, no alert expected);
3. `convert_to_proxy.py` of the SFT checkpoint to a 4-expert proxy at EP=1 (1 rank);
4. original (2 ranks) and proxy (1 rank) under `rollout-router-noise` without routing replay, and the
   original again with R3 (the control): the rl family's routing-mismatch alert on both faulted runs,
   none under R3.

    .venv/bin/python examples/rl_demo.py [--work-dir runs/rl_demo] [--rl-steps 200]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The demo's objective, explicit (Megatron-LM's defaults differ: 2 iterations, eps 0.01, KL beta 0.001, constant-
# reward groups kept): one pass per step, eps 0.2, no KL, constant-reward groups left out.
OBJECTIVE = ["--grpo-iterations", "1", "--grpo-clamp-eps-lower", "0.2", "--grpo-clamp-eps-upper", "0.2",
             "--grpo-kl-beta", "0", "--grpo-filter-groups-with-same-reward"]
GRPO = ["--lr", "5e-4", "--min-lr", "5e-4", "--grpo-prompts-per-step", "16", "--grpo-group-size", "8",
        "--log-interval", "25", "--seed", "1234"] + OBJECTIVE
FAULT = "rollout-router-noise:start=15,std=0.5"


def run(cmd: list[str], ranks: int, log: str) -> float:
    """Run one command (under torchrun when `ranks` > 1); its output goes to `log`; returns seconds."""
    from mindspeed_proxy.determinism import PINNED_ENV

    env = {**os.environ, **PINNED_ENV, "PYTHONPATH": ROOT}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)] if ranks > 1 \
        else [sys.executable]
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.run(launcher + cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"rl_demo: {' '.join(cmd[:3])} failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - start


def records(log_dir: str, kind: str) -> list[dict]:
    """Records of `kind` in a run's metrics.jsonl."""
    with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return [r for r in map(json.loads, fh) if r.get("type") == kind]


def alerts(log_dir: str) -> list[dict]:
    """The mechanism monitor's alerts of a run."""
    path = os.path.join(log_dir, "mechanism_monitor", "monitor.jsonl")
    with open(path, encoding="utf-8") as fh:
        return [r for r in map(json.loads, fh) if r.get("type") == "alert"]


def main(argv=None) -> int:
    """SFT, GRPO, convert, faulted original / proxy / R3 control; prints what each step measured."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "rl_demo"))
    p.add_argument("--rl-steps", type=int, default=200)
    p.add_argument("--fault-steps", type=int, default=40)
    a = p.parse_args(argv)
    work = os.path.abspath(a.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    t0 = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {message}", flush=True)

    sft, proxy = os.path.join(work, "sft"), os.path.join(work, "proxy")
    say(f"1/4 SFT warm-up (2 ranks, EP=2); outputs in {work}")
    run(["-m", "mindspeed_proxy.rl.sft", "--expert-model-parallel-size", "2", "--train-iters", "200",
         "--log-interval", "50", "--save", sft, "--log-dir", os.path.join(work, "sft_logs")], 2,
        os.path.join(work, "sft.log"))
    (ev,) = records(os.path.join(work, "sft_logs"), "eval")
    say(f"    SFT eval reward {ev['eval_reward']:.3f} ({ev['eval_rollouts']} sampled rollouts)")
    say(f"2/4 GRPO, {a.rl_steps} steps, monitor on (2 ranks, EP=2)")
    healthy = os.path.join(work, "grpo")
    run(["-m", "mindspeed_proxy.rl.train", "--expert-model-parallel-size", "2", "--load", sft,
         "--train-iters", str(a.rl_steps), "--enable-mechanism-monitor", "--log-dir", healthy] + GRPO, 2,
        os.path.join(work, "grpo.log"))
    before, after = records(healthy, "eval")
    say(f"    eval reward {before['eval_reward']:.3f} -> {after['eval_reward']:.3f} "
        f"(+{after['eval_reward'] - before['eval_reward']:.3f}); alerts on the healthy run: {len(alerts(healthy))}")
    say("3/4 convert_to_proxy.py: 8 experts at EP=2 -> 4 experts at EP=1")
    run([os.path.join(ROOT, "convert_to_proxy.py"), "--load", sft, "--save", proxy,
         "--target-expert-parallel-size", "1", "--target-num-experts", "4"], 1, os.path.join(work, "convert.log"))
    say(f"4/4 {FAULT} for {a.fault_steps} steps: original, proxy, and original with R3")
    runs = {
        "original": (["--expert-model-parallel-size", "2", "--load", sft], 2),
        "proxy": (["--expert-model-parallel-size", "1", "--num-experts", "4", "--load", proxy], 1),
        "original, R3": (["--expert-model-parallel-size", "2", "--load", sft, "--rl-routing-replay", "r3"], 2),
    }
    rows = []
    for name, (flags, ranks) in runs.items():
        log_dir = os.path.join(work, "fault_" + name.replace(", ", "_").replace(" ", "_"))
        seconds = run(["-m", "mindspeed_proxy.rl.train", *flags, "--train-iters", str(a.fault_steps),
                       "--rl-eval-prompts", "0", "--enable-mechanism-monitor", "--inject-fault", FAULT,
                       "--log-dir", log_dir] + GRPO, ranks, os.path.join(work, f"{os.path.basename(log_dir)}.log"))
        found = [x for x in alerts(log_dir) if x["mechanism"].startswith("routing-mismatch")]
        steps = records(log_dir, "step")
        rows.append((name, found[0]["step"] if found else None, found[0]["metric"] if found else "-",
                     min(r["topk_match_mean"] for r in steps), [r["reward_mean"] for r in steps], ranks, seconds))
    print("\n| run | ranks | first routing-mismatch alert | metric | min top-k match | wall s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, step, metric, match, _, ranks, seconds in rows:
        print(f"| {name} | {ranks} | {step if step is not None else 'none'} | {metric} | {match:.4f} | {seconds:.0f} |")
    from mindspeed_proxy.experiments.rl_tables import pearson

    r = pearson(rows[0][4], rows[1][4]) or float("nan")
    print(f"\nproxy reproduces the fault: alert on both faulted runs: "
          f"{'yes' if rows[0][1] and rows[1][1] else 'NO'}; none under R3: {'yes' if rows[2][1] is None else 'NO'}; "
          f"reward Pearson original vs proxy over the faulted runs: {r:.3f}")
    say("rl demo done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
