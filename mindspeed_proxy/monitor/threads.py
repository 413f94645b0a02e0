"""The monitor's thread use: its many small linear-algebra calls run on one thread, whatever the trainer's count.

The QK core, the ΔW spectra and the router statistics are hundreds of small GEMM / syrk / Cholesky /
eigvalsh / reduction calls. Spread over torch's OpenMP pool each one pays a fork/join larger than its
work, numpy's OpenBLAS pool (the syrk calls) is a second set of spinning threads competing for the same
cores, and on a loaded machine one descheduled worker stalls every call (docs/benchmarks.md has the
per-stage figures). `single_threaded()` runs a block with torch's intra-op threads at 1 and, with
`blas=True`, the BLAS pools limited to 1 through threadpoolctl; the previous settings come back when
the block ends, an exception included. Blocks nest (only the outermost one sets and restores) and may
be entered from several threads (the settings are process-wide; the last block to leave restores them).
"""
from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Optional

import torch

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_depth = 0  # open blocks (any blas setting)
_outer_threads: Optional[int] = None  # torch's thread count when the outermost block opened
_blas_depth = 0  # open blocks with blas=True
_blas_limiter = None  # threadpoolctl limiter of the outermost blas block
_controller = None  # threadpoolctl.ThreadpoolController, built once (it scans the loaded libraries, ~1 ms)


def _blas_controller():
    """The process's threadpoolctl controller (built on first use; numpy's BLAS is loaded by then)."""
    global _controller
    if _controller is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # an install without it: torch's pool is still limited, said once
            logger.warning("threadpoolctl is not installed: the monitor leaves the BLAS thread pools as they are")
            _controller = False
        else:
            _controller = ThreadpoolController()
    return _controller or None


def outer_threads() -> int:
    """torch's intra-op thread count outside any `single_threaded` block (the trainer's count)."""
    with _lock:
        return _outer_threads if _depth else torch.get_num_threads()


def _enter(blas: bool) -> None:
    global _depth, _outer_threads, _blas_depth, _blas_limiter
    with _lock:
        if blas and _blas_depth == 0:
            controller = _blas_controller()
            _blas_limiter = controller.limit(limits=1, user_api="blas") if controller is not None else None
        if _depth == 0:
            _outer_threads = torch.get_num_threads()
            if _outer_threads != 1:
                torch.set_num_threads(1)
        _depth += 1
        _blas_depth += 1 if blas else 0


def _leave(blas: bool) -> None:
    global _depth, _outer_threads, _blas_depth, _blas_limiter
    with _lock:
        _depth -= 1
        if _depth == 0:
            if torch.get_num_threads() != _outer_threads:
                torch.set_num_threads(_outer_threads)
            _outer_threads = None
        if blas:
            _blas_depth -= 1
            if _blas_depth == 0:
                limiter, _blas_limiter = _blas_limiter, None
                if limiter is not None:
                    limiter.restore_original_limits()


@contextmanager
def single_threaded(blas: bool = True):
    """Run the block (or, as a decorator, the function) with torch at 1 thread and, if `blas`, the BLAS pools at 1."""
    _enter(blas)
    try:
        yield
    finally:
        _leave(blas)
