"""Expert weight Grams streamed from a checkpoint: column blocks read straight into one buffer."""
from __future__ import annotations

import os

import numpy as np
import torch

from mindspeed_proxy.proxy.core.refs import LayerRef
from mindspeed_proxy.proxy.io import pages
from mindspeed_proxy.proxy.io.protocol import SourceCheckpoint
from mindspeed_proxy.proxy.select.similarity import PRODUCT_COLUMNS, block_gram, similarity_from_parts

BLOCK_BYTES = 4 << 20  # the staging buffer (E x columns); source pages are dropped once copied into it


def streamed_gram(rows: list, block_bytes: int = BLOCK_BYTES, columns: int = PRODUCT_COLUMNS) -> np.ndarray:
    """X Xᵀ (float64) for X whose row i is `rows[i]` flattened: column blocks gathered into one float32
    buffer (float64 if a row is float64), multiplied in that dtype over `columns` columns at a time,
    summed in float64. Rows memory-mapped from a registered checkpoint file are read with pread straight
    into the buffer (their mapping is never touched); others are copied, their mapped pages dropped."""
    n = len(rows)
    flat = [r.reshape(-1) for r in rows]
    length = flat[0].numel()
    if any(f.numel() != length for f in flat):
        raise ValueError("experts of one layer have different sizes")
    dtype = torch.float64 if any(f.dtype == torch.float64 for f in flat) else torch.float32
    block = max(1, min(length, block_bytes // (dtype.itemsize * n)))
    gram = np.zeros((n, n))
    buffer = torch.empty(n, block, dtype=dtype)
    sources = pages.file_ranges(flat)
    files: dict = {}
    staging: dict = {}
    try:
        for path in {s[0] for s in sources if s}:
            files[path] = os.open(path, os.O_RDONLY)
        for start in range(0, length, block):
            width = min(block, length - start)
            for i, f in enumerate(flat):
                row = buffer[i, :width]
                if sources[i] is None:
                    piece = f[start:start + width]
                    row.copy_(piece)
                    pages.drop(piece)  # memory-mapped source pages leave RSS once read
                    continue
                path, offset = sources[i]
                if f.dtype != dtype and f.dtype not in staging:
                    staging[f.dtype] = torch.empty(block, dtype=f.dtype)
                target = row if f.dtype == dtype else staging[f.dtype][:width]
                pages.pread_into(files[path], target, offset + start * f.element_size(), path)
                if target is not row:
                    row.copy_(target)
            gram += block_gram(buffer[:, :width].numpy(), columns)
    finally:
        for fd in files.values():
            os.close(fd)
    return gram


def weight_grams(ckpt: SourceCheckpoint, layer: LayerRef) -> list:
    """[E x E Gram of the flattened expert weights, E x E Gram of the router rows] (float64) of `layer`."""
    L = ckpt.layout
    gram = np.zeros((L.num_experts, L.num_experts))
    for rows in ckpt.expert_row_groups(layer):
        gram += streamed_gram(rows)
    router = ckpt.router(layer)["weight"].to(torch.float64)
    return [gram, (router @ router.T).numpy()]


def weight_similarity(ckpt: SourceCheckpoint, layer: LayerRef) -> np.ndarray:
    """E x E cosine similarity of `layer`'s experts: flattened weights (+) router rows, equally weighted."""
    return similarity_from_parts(weight_grams(ckpt, layer))
