"""The QK Gram core's FLOP count and its GEMM bound: the core's flops over the GEMM throughput of its own shapes.

`core_flops` counts what `monitor/qk_gram.py` and `monitor/spectral.py` run, per call, split by dtype:
- the d-long products in the inputs' dtype (fp32 here), per factor block [d, h] (query heads, key blocks):
  the difference Δ = W' − W (d·h), ΔᵀΔ by syrk (h(h+1)·d: the lower triangle, 2 flops per multiply-add),
  WᵀΔ by GEMM (2h²·d), and, cold only, WᵀW by syrk (h(h+1)·d); steady passes the old Gram in;
- the 2h×2h problem in float64 per query head (m = 2h): Cholesky (m³/3), the core FᵀG_BF as the
  code forms it (two m×m GEMMs, 4m³) or by LAPACK's sygst (m³), and the eigenvalues (tridiagonal reduction
  4m³/3; the tridiagonal QR is O(m²) and left out).
`gemm_throughput` measures torch.matmul on the core's shapes (the d-long [c, h, d]·[c, d, h] batch of one
chunk in fp32, a [c, m, m]·[c, m, m] batch in float64) at a thread count. The bound is Σ flops / throughput: the core
could not be faster than its flops at the GEMM rate of its own shapes; syrk, Cholesky and the tridiagonal
reduction run below that rate, which is what the measured multiple of the bound shows.
"""
from __future__ import annotations

import time

import torch


def core_flops(d: int, h: int, heads: int, key_blocks: int, cold: bool, core_gemms: bool = True) -> dict:
    """FLOPs of one Gram-core call on `heads` query heads and `key_blocks` key blocks: {"fp32": .., "fp64": ..}."""
    syrk, gemm = h * (h + 1) * d, 2 * h * h * d
    per_block = d * h + syrk + gemm + (syrk if cold else 0)
    m = 2 * h
    small = m ** 3 / 3 + (4 * m ** 3 if core_gemms else m ** 3) + 4 * m ** 3 / 3
    return {"fp32": float(per_block * (heads + key_blocks)), "fp64": float(small * heads)}


def _best_seconds(fn, repeats: int) -> tuple[float, float]:
    """Best wall time and best CPU time of this process of `fn` over `repeats` runs after one warm-up."""
    fn()
    wall = cpu = float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    return wall, cpu


def gemm_throughput(d: int, h: int, chunk: int, repeats: int = 7, seed: int = 0) -> dict:
    """GFLOP/s of torch.matmul on the core's shapes at the current thread count, per wall second and per
    CPU second of the process: {"wall": {"fp32": .., "fp64": ..}, "cpu": {...}}."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(chunk, h, d, generator=gen)
    diff = torch.randn(chunk, h, d, generator=gen)
    out32 = torch.empty(chunk, h, h)
    m = 2 * h
    a, b = (torch.randn(chunk, m, m, generator=gen, dtype=torch.float64) for _ in range(2))
    out64 = torch.empty(chunk, m, m, dtype=torch.float64)
    t32 = _best_seconds(lambda: torch.matmul(rows, diff.mT, out=out32), repeats)
    t64 = _best_seconds(lambda: torch.matmul(a, b, out=out64), repeats)
    flops = {"fp32": 2 * chunk * h * h * d, "fp64": 2 * chunk * m ** 3}
    return {kind: {"fp32": flops["fp32"] / t32[i] / 1e9, "fp64": flops["fp64"] / t64[i] / 1e9}
            for i, kind in enumerate(("wall", "cpu"))}


def bound_seconds(flops: dict, gflops: dict) -> float:
    """Σ flops / throughput over the dtypes."""
    return sum(flops[k] / (gflops[k] * 1e9) for k in flops)
