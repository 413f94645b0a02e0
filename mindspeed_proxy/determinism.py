"""What decides the numbers of a CPU run besides its seed: threads and the kernels' instruction set.

On one machine a run is bit-identical from run to run (one thread per rank, seeded init and data order,
a fixed gloo reduction order). Across machines the BLAS and torch's own vectorised kernels pick a code path
by the CPU's instruction set (AVX2 / AVX-512), and each rounds differently; the `env` block of
examples/configs/fault_matrix.yaml pins those paths (docs/determinism.md). `numerics_record()` is written
into the `args` record of every run's metrics.jsonl (key `numerics`) so that two runs' settings can be compared.
"""
from __future__ import annotations

import os
import platform

# environment variables that change which kernels run or how many threads they use
NUMERIC_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "ATEN_CPU_CAPABILITY", "MKL_CBWR",
               "OPENBLAS_CORETYPE", "ONEDNN_MAX_CPU_ISA", "PYTHONHASHSEED")
# what the demos and matrices launch every process with: one thread, the AVX2 code path of torch's kernels and
# OpenBLAS, which any x86-64 CPU with AVX2 takes, and MKL's COMPATIBLE branch, the one MKL honours on Intel and
# non-Intel CPUs alike (AVX2 runs AUTO on AMD); docs/determinism.md: what each one changed, measured
PINNED_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "OPENBLAS_CORETYPE": "Haswell",
              "PYTHONHASHSEED": "0"}


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def numerics_record() -> dict:
    """The settings this process computes under: torch version, ATen ISA, threads, pinning env vars, CPU."""
    import torch

    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "env": {k: os.environ.get(k) for k in NUMERIC_ENV},
            "cpu": cpu_model()}
