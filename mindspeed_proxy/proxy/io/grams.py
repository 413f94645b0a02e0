"""Expert weight Grams streamed from a checkpoint: column blocks read straight into two alternating buffers.

The Gram is thousands of small float32 syrk calls (E x 8192 columns each). numpy's OpenBLAS runs them on
one thread here: spread over its pool, each call woke a second thread that then spun between calls; on 2
cores that spinning took the core the source pass's reading and hashing threads needed (docs/benchmarks.md).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from mindspeed_proxy.monitor.threads import single_threaded
from mindspeed_proxy.proxy.core.refs import LayerRef
from mindspeed_proxy.proxy.io import pages
from mindspeed_proxy.proxy.io.protocol import SourceCheckpoint
from mindspeed_proxy.proxy.select.similarity import PRODUCT_COLUMNS, block_gram, similarity_from_parts

BLOCK_BYTES = 4 << 20  # each of the two staging buffers (E x columns); source pages are dropped once copied


def streamed_gram(rows: list, block_bytes: int = BLOCK_BYTES, columns: int = PRODUCT_COLUMNS) -> np.ndarray:
    """X Xᵀ (float64) for X whose row i is `rows[i]` flattened: column blocks gathered into a float32
    buffer (float64 if a row is float64), multiplied in that dtype over `columns` columns at a time,
    summed in float64. Rows memory-mapped from a registered checkpoint file are read with pread straight
    into the buffer (their mapping is never touched); others are copied, their mapped pages dropped. The
    next block is gathered by two threads (half of the rows each) while this one is multiplied (two buffers)."""
    n = len(rows)
    flat = [r.reshape(-1) for r in rows]
    length = flat[0].numel()
    if any(f.numel() != length for f in flat):
        raise ValueError("experts of one layer have different sizes")
    dtype = torch.float64 if any(f.dtype == torch.float64 for f in flat) else torch.float32
    block = max(1, min(length, block_bytes // (dtype.itemsize * n)))
    gram = np.zeros((n, n))
    starts = range(0, length, block)
    halves = [range(0, n // 2), range(n // 2, n)] if n > 1 else [range(n)]
    with _Gather(flat, dtype, block) as gather, \
            ThreadPoolExecutor(len(halves), thread_name_prefix="proxy-gram-read") as pool:
        def submit(slot: int, start: int) -> list:
            return [pool.submit(gather.fill, slot, start, rows) for rows in halves]

        pending = submit(0, 0)
        for k, start in enumerate(starts):
            width = [p.result() for p in pending][0]
            if k + 1 < len(starts):
                pending = submit((k + 1) % 2, starts[k + 1])
            gram += block_gram(gather.buffers[k % 2][:, :width].numpy(), columns)
    return gram


class _Gather:
    """Fills one of two E x block buffers with columns [start, start + block) of every row."""

    def __init__(self, flat: list, dtype: torch.dtype, block: int):
        self.flat, self.dtype, self.block = flat, dtype, block
        self.buffers = [torch.empty(len(flat), block, dtype=dtype) for _ in range(2)]
        self.raw = [memoryview(b.view(-1).view(torch.uint8).numpy()) for b in self.buffers]  # pread targets
        self.sources = pages.file_ranges(flat)
        self.files: dict = {}
        self.staging: dict = {}

    def __enter__(self):
        try:
            for path in {s[0] for s in self.sources if s}:
                self.files[path] = os.open(path, os.O_RDONLY)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for fd in self.files.values():
            os.close(fd)
        self.files.clear()

    def fill(self, slot: int, start: int, rows: range) -> int:
        """Gather columns from `start` of `rows` into buffer `slot`; return how many columns (the block's width)."""
        width = min(self.block, self.flat[0].numel() - start)
        buffer, raw, size = self.buffers[slot], self.raw[slot], self.dtype.itemsize
        for i in rows:
            f = self.flat[i]
            row = buffer[i, :width]
            if self.sources[i] is None:
                piece = f[start:start + width]
                row.copy_(piece)
                pages.drop(piece)  # memory-mapped source pages leave RSS once read
                continue
            path, offset = self.sources[i]
            if f.dtype == self.dtype:
                target = raw[i * self.block * size:(i * self.block + width) * size]
            else:
                target = self.staging.setdefault((f.dtype, rows.start), torch.empty(self.block, dtype=f.dtype))[:width]
            pages.pread_into(self.files[path], target, offset + start * f.element_size(), path)
            if f.dtype != self.dtype:
                row.copy_(target)
        return width


def weight_grams(ckpt: SourceCheckpoint, layer: LayerRef) -> list:
    """[E x E Gram of the flattened expert weights, E x E Gram of the router rows] (float64) of `layer`."""
    L = ckpt.layout
    gram = np.zeros((L.num_experts, L.num_experts))
    with single_threaded(blas=True):  # numpy's BLAS pool at 1 (module docstring)
        for rows in ckpt.expert_row_groups(layer):
            gram += streamed_gram(rows)
    router = ckpt.router(layer)["weight"].to(torch.float64)
    return [gram, (router @ router.T).numpy()]


def weight_similarity(ckpt: SourceCheckpoint, layer: LayerRef) -> np.ndarray:
    """E x E cosine similarity of `layer`'s experts: flattened weights (+) router rows, equally weighted."""
    return similarity_from_parts(weight_grams(ckpt, layer))
