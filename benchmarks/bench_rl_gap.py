"""Cost of the train–rollout gap decomposition per RL step: step time with `--rl-gap-interval 1` vs a plain step.

python benchmarks/bench_rl_gap.py [--steps 12] [--samples 8] [--layer-attribution] [--threads 1,all] [--rounds 1]
                                  [--model tiny|small] [--workdir DIR]

For each thread count (OMP_NUM_THREADS; "all" = every core) runs our GRPO loop on one rank three times
(`torch.distributed.run`, fresh process each): plain, with the decomposition every step on --samples rows,
and (with --layer-attribution) with the per-layer attribution every step as well. Reports the median
`step_time_s` of metrics.jsonl over the steps after the first two, and the ratio to the plain step. The
decomposition adds three no-grad forwards of --samples rows (plus one per MoE layer with the attribution).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

MODELS = {
    "tiny": ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--moe-ffn-hidden-size", "32",
             "--num-attention-heads", "4", "--num-query-groups", "2"],
    "small": ["--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "512", "--moe-ffn-hidden-size",
              "256", "--num-attention-heads", "8", "--num-query-groups", "4"],
}


def run(workdir: str, name: str, model: list, steps: int, threads: int, extra: list) -> tuple:
    """(median step time in s, CPU seconds of the whole process tree) of one GRPO run of `steps` steps."""
    log = os.path.join(workdir, name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "mindspeed_proxy.rl.train",
           *model, "--train-iters", str(steps), "--grpo-prompts-per-step", "8", "--grpo-group-size", "4",
           "--micro-batch-size", "8", "--rl-eval-prompts", "0", "--grpo-iterations", "1", "--seed", "3",
           "--log-interval", "1000", "--log-dir", log, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    with open(os.path.join(log, "metrics.jsonl"), encoding="utf-8") as fh:
        times = [r["step_time_s"] for r in map(json.loads, fh) if r.get("type") == "step"]
    return statistics.median(times[2:] or times), cpu


def main(argv=None) -> int:
    """Run the comparison and print one row per (threads, configuration)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--samples", type=int, default=8, help="--rl-gap-samples")
    p.add_argument("--layer-attribution", action="store_true")
    p.add_argument("--threads", default="1,all")
    p.add_argument("--model", choices=list(MODELS), default="tiny")
    p.add_argument("--workdir", default=None)
    p.add_argument("--rounds", type=int, default=1, help="repeat the configurations in turn; report the minimum")
    args = p.parse_args(argv)
    configs = {"plain": [], "gap": ["--rl-gap-interval", "1", "--rl-gap-samples", str(args.samples)]}
    if args.layer_attribution:
        configs["gap+layers"] = configs["gap"] + ["--rl-gap-layer-interval", "1"]
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_rl_gap_")
    print(f"model {args.model}, {args.steps} steps, 32 rollouts/step, --rl-gap-samples {args.samples}")
    print("wall: median step time (min over rounds); CPU: the run's process-tree CPU seconds (min over rounds), "
          "its excess over plain divided by the steps is the decomposition's CPU per step (start-up cancels)")
    for spec in args.threads.split(","):
        threads = os.cpu_count() if spec == "all" else int(spec)
        best: dict = {}
        for r in range(args.rounds):  # configurations in turn, so that each round sees the same load
            for name, extra in configs.items():
                t, cpu = run(workdir, f"{name}_t{threads}_r{r}", MODELS[args.model], args.steps, threads, extra)
                old = best.get(name, (float("inf"), float("inf")))
                best[name] = (min(old[0], t), min(old[1], cpu))
        base_t, base_cpu = best["plain"]
        for name, (t, cpu) in best.items():
            print(f"threads {threads:3d} | {name:10s} | step {t * 1000:8.1f} ms | x{t / base_t:.3f} of plain | "
                  f"CPU {cpu:7.1f} s | +{(cpu - base_cpu) / args.steps * 1000:7.1f} ms CPU per step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
