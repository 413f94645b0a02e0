"""Cost of the mechanism monitor on the tiny MoE, as a fraction of its training step (same process, same run).

    python benchmarks/bench_monitor_overhead.py [--steps 40] [--layers 4] [--hidden-size 256] [--threads N] [--quick]

Everything below runs at 1 thread and at all cores (`--threads`, default the CPU count: torch's intra-op
threads and the BLAS pools) in one run, the same model and optimizer continuing from one to the next.
The monitor runs its own calls on one thread (`monitor/threads.py`) whatever the trainer's count.

Router statistics use the default router_interval (accumulate every step, reduce/detect/log every
10th), so their cost is the mean over steps. Measures the median step time with no monitor, then, with the monitor on, the time spent inside the
monitor itself per step (router hooks incl. the logits they recompute, accumulation, reduction,
detectors; timed around each call, so other load on the machine does not leak into the figure):
(a) router statistics every step, (b) every family sampled every step (interval = δ = 1). Reports
router cost / step (target ≤1% at both counts), one spectral sample amortised over interval=100 (target ≤1%)
and the spectral sample's time at all cores against 1 thread (target: no slower). `--quick`: 2 layers,
10 steps (a smoke run, not a measurement).
"""
import argparse
import os
import statistics
import time

import torch
from threadpoolctl import threadpool_limits


def median_step(trainer, train_cfg, model_cfg, steps, start):
    """Median seconds of `steps` train steps (after 3 warm-up steps)."""
    from mindspeed_proxy.testing.batches import synthetic_microbatches
    from mindspeed_proxy.training.engine import microbatch_sample_ids

    times = []
    for it in range(start, start + steps + 3):
        batches = synthetic_microbatches(microbatch_sample_ids(train_cfg, it), model_cfg.seq_length,
                                         model_cfg.vocab_size)
        t0 = time.perf_counter()
        trainer.train_step(batches, iteration=it + 1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


class Timed:
    """Wraps the monitor's entry points and sums the seconds spent in them per step."""

    def __init__(self, monitor):
        self.monitor, self.current, self.per_step = monitor, 0.0, []
        for name in ("on_router_logits", "after_optimizer_step"):
            setattr(monitor, name, self._wrap(getattr(monitor, name), name == "after_optimizer_step"))

    def _wrap(self, fn, ends_step):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            fn(*args, **kwargs)
            self.current += time.perf_counter() - t0
            if ends_step:
                self.per_step.append(self.current)
                self.current = 0.0
        return timed

    def median(self):
        """Median monitor seconds per step (after 3 warm-up steps)."""
        return statistics.median(self.per_step[3:])

    def mean(self):
        """Mean monitor seconds per step (after 3 warm-up steps): amortises every-N-step work."""
        return statistics.fmean(self.per_step[3:])


def measure(trainer, train_cfg, model_cfg, steps, start):
    """(step s without monitor, with router stats, with everything; router s/step, sample s, bytes held)."""
    from mindspeed_proxy.monitor import MechanismMonitor, MonitorConfig
    from mindspeed_proxy.testing.routing import routed_to

    trainer.monitor = None
    base = median_step(trainer, train_cfg, model_cfg, steps, start)
    router_only = MechanismMonitor(MonitorConfig(families=["router"], sinks=[]), trainer.model, trainer.optimizer)
    timer = Timed(router_only)
    trainer.monitor = router_only
    with routed_to(router_only):
        with_router = median_step(trainer, train_cfg, model_cfg, steps, start + 100)
    router_cost = timer.mean()

    everything = MechanismMonitor(MonitorConfig(interval=1, delta=1, sinks=[]), trainer.model, trainer.optimizer)
    timer = Timed(everything)
    trainer.monitor = everything
    with routed_to(everything):
        with_all = median_step(trainer, train_cfg, model_cfg, steps, start + 200)
    sample_cost = timer.median() - router_cost
    trainer.monitor = None
    held = everything.bytes_held()
    everything.close()
    return base, with_router, with_all, router_cost, sample_cost, held


def main():
    """Run the three configurations at 1 thread and at all cores and print the tables and targets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="the all-cores count (default: CPUs)")
    parser.add_argument("--quick", action="store_true", help="2 layers, 10 steps: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.steps = 2, 10
    from mindspeed_proxy import platform

    platform.activate("cpu")
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    from mindspeed_proxy.testing import init_parallel
    from mindspeed_proxy.tiny_moe import TinyMoEConfig
    from mindspeed_proxy.training.engine import TrainConfig, Trainer

    init_parallel()
    model_cfg = TinyMoEConfig(num_layers=args.layers, hidden_size=args.hidden_size, seq_length=args.seq_length,
                              ffn_hidden_size=2 * args.hidden_size, moe_ffn_hidden_size=args.hidden_size)
    train_cfg = TrainConfig(micro_batch_size=4, global_batch_size=8)
    trainer = Trainer(model_cfg, train_cfg)
    load_start = os.getloadavg()[0]
    counts = sorted({1, max(1, args.threads)})
    results = {}
    for i, n in enumerate(counts):
        torch.set_num_threads(n)
        with threadpool_limits(n, user_api="blas"):
            results[n] = measure(trainer, train_cfg, model_cfg, args.steps, 1000 * i)
    print(f"tiny MoE: {args.layers} layers, hidden {model_cfg.hidden_size}, seq {model_cfg.seq_length}, "
          f"{model_cfg.num_experts} experts, 1 rank, {args.steps} steps")
    print(f"{'threads':>7}  {'configuration':<40}{'median step (ms)':>18}{'inside monitor (ms)':>22}")
    for n, (base, with_router, with_all, router_cost, sample_cost, _) in results.items():
        print(f"{n:>7}  {'no monitor':<40}{base * 1e3:>18.2f}{0:>22.2f}")
        print(f"{n:>7}  {'router statistics (default interval)':<40}{with_router * 1e3:>18.2f}{router_cost * 1e3:>22.2f}")
        print(f"{n:>7}  {'all families sampled every step':<40}{with_all * 1e3:>18.2f}"
              f"{(router_cost + sample_cost) * 1e3:>22.2f}")
    if args.quick:
        print("(--quick: a smoke run; the targets are meant for the default steps and layers)")
    for n, (base, _, _, router_cost, sample_cost, held) in results.items():
        share = 100 * router_cost / base
        print(f"{n} thread(s): router stats / step: {share:.2f}% (target <= 1%) {'PASS' if share <= 1 else 'FAIL'}; "
              f"spectral sample: {sample_cost * 1e3:.2f} ms = {sample_cost / base:.2f} steps; amortised over "
              f"interval 100: {100 * sample_cost / base / 100:.2f}% (target <= 1%); snapshot bytes held: {held}")
    if len(counts) > 1:
        one, top = results[1][4], results[counts[-1]][4]
        print(f"spectral sample at {counts[-1]} threads vs 1: {one * 1e3:.2f} -> {top * 1e3:.2f} ms "
              f"({top / one:.2f}x; target: no slower) {'PASS' if top <= one else 'FAIL'}; training step "
              f"{results[1][0] * 1e3:.2f} -> {results[counts[-1]][0] * 1e3:.2f} ms")
    print(f"load average at start {load_start:.2f}, at end {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
