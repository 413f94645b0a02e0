"""Time and peak memory of one monitor sample on DeepSpeed at ZeRO-3 against ZeRO-2 (same model, 2 gloo ranks).

    python benchmarks/bench_deepspeed_zero3.py [--layers 4] [--hidden 256] [--experts 16] [--steps 3]

A Qwen3-MoE (transformers) trains under ZeRO-2 and ZeRO-3 with the monitor sampling every step (interval 1,
δ 1: attention-spectral, update-spectral and the router family, so each `monitor.step()` is a full sample plus
the next snapshot). Per stage and per torch thread count (1, and all cores per rank), the median over
--steps of rank 0's `monitor.step()` wall time, and the peak of the process's resident memory during those calls
above its level just before (RSS polled every millisecond by a thread: CPU has no allocator high-water mark;
the ranks run with MALLOC_MMAP_THRESHOLD_=65536, so every tensor of 64 KiB or more is its own mapping, returned
to the system when freed, and the RSS follows the live tensors instead of glibc's retained heap); then the
ZeRO-3 / ZeRO-2 ratios. ZeRO-3 gathers one decoder layer's monitored parameters at a time
(hosts/deepspeed.py `zero3_gather`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class PeakRSS:
    """Peak resident set size (bytes) above the level at entry, polled every millisecond."""

    def __enter__(self):
        import psutil

        self._proc, self._stop = psutil.Process(), threading.Event()
        self.base = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        self.extra = self.peak - self.base


def model(layers: int, hidden: int, experts: int):
    """A Qwen3-MoE of `layers` layers, `hidden` wide, `experts` experts top-2 (seed 0)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    heads = max(hidden // 64, 2)
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                         moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads // 2, head_dim=64, num_experts=experts, num_experts_per_tok=2,
                         max_position_embeddings=64, attn_implementation="eager", tie_word_embeddings=False)
    torch.manual_seed(0)
    m = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.1)
    return m.train()


def rank_job(stage: int, threads: int, layers: int, hidden: int, experts: int, steps: int) -> dict:
    """Train `steps` + 1 steps at ZeRO-`stage`; time rank's monitor.step() calls after the first."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from mindspeed_proxy.hosts.deepspeed import attach_monitor, skip_shm_comm_build

    skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(threads)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True,
              "mechanism_monitor": {"interval": 1, "delta": 1, "router_interval": 1, "sinks": [],
                                    "families": ["attention-spectral", "update-spectral", "router"]}}
    m = model(layers, hidden, experts)
    engine, *_ = deepspeed.initialize(model=m, config=config, model_parameters=m.parameters())
    monitor = attach_monitor(engine, config)
    rank, seconds, extra = dist.get_rank(), [], []
    g = torch.Generator().manual_seed(rank)
    for step in range(steps + 1):
        ids = torch.randint(0, 512, (2, 64), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        dist.barrier()
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            monitor.step()
            seconds.append(time.perf_counter() - t0)
        extra.append(mem.extra)
    assert not monitor.disabled - {"rl", "expert-features"}, monitor.disabled
    monitor.close()
    engine.destroy()
    return {"seconds": statistics.median(seconds[1:]), "peak_extra_mib": max(extra[1:]) / 2**20}


def main(argv=None) -> int:
    """Run both stages at 1 thread and at all cores per rank; print the table and the ratios."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # glibc reads it at start: run again with it set
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__)] + list(argv or sys.argv[1:]))
    from mindspeed_proxy.testing import run_distributed

    cores = os.cpu_count() or 1
    print(f"Qwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts; 2 gloo ranks; "
          f"median of {args.steps} samples (rank 0)")
    print(f"{'threads/rank':>12} {'ZeRO-2 s':>9} {'ZeRO-3 s':>9} {'ratio':>6} {'ZeRO-2 MiB':>10} {'ZeRO-3 MiB':>10} "
          f"{'ratio':>6}")
    for threads in sorted({1, cores}):
        r = {stage: run_distributed(rank_job, 2, stage, threads, args.layers, args.hidden, args.experts,
                                    args.steps, timeout=900)[0]
             for stage in (2, 3)}
        print(f"{threads:>12} {r[2]['seconds']:>9.3f} {r[3]['seconds']:>9.3f} "
              f"{r[3]['seconds'] / r[2]['seconds']:>6.2f} {r[2]['peak_extra_mib']:>10.1f} "
              f"{r[3]['peak_extra_mib']:>10.1f} {r[3]['peak_extra_mib'] / max(r[2]['peak_extra_mib'], 1e-9):>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
