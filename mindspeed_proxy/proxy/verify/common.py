"""Shared by the verifiers: bit equality, block-wise comparison, the streamed source comparison."""
from __future__ import annotations

import os

import torch

from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.io import hashing, pages


def bit_equal(a, b) -> bool:
    """Same dtype, shape and bytes (NaNs included); non-tensors compared with ==."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return type(a) is type(b) and a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _fail(path: str, what: str) -> None:
    raise ConversionError(f"verification failed: {path}: {what}")


def check_args(path: str, args, plan, source_args) -> None:
    """The proxy's saved args: the target layout's four counts, every other source arg unchanged unless planned."""
    tgt = plan.target
    for name, value in (("num_experts", tgt.num_experts), ("expert_model_parallel_size", tgt.ep),
                        ("world_size", tgt.world_size), ("data_parallel_size", tgt.dp)):
        if getattr(args, name, None) != value:
            _fail(path, f"args.{name} = {getattr(args, name, None)}, expected {value}")
    for name, value in vars(source_args).items():
        if name not in plan.args_diff and getattr(args, name, None) != value:
            _fail(path, f"args.{name} changed from {value!r} to {getattr(args, name, None)!r}")


class StreamCompare:
    """Tensor equality from digests, without re-reading the written file: the proxy tensor's bytes are
    located in its file (mmap, nothing touched) and matched to the digest of that written record
    (RecordingWriter); the expected tensor's bytes are a source record whose digest the source pass took
    while reading the source (else they are hashed now). Anything else is compared byte for byte."""

    def __init__(self, written: dict, source):
        self.written = {os.path.realpath(p): d for p, d in written.items()}
        self.source = source
        self.counts = {"bytes_from_digests": 0, "source_bytes_hashed_again": 0, "bytes_compared_by_reading": 0}

    def _written_digest(self, tensor, where):
        if where is None:
            return None
        return self.written.get(where[0], {}).get((where[1], tensor.nbytes))

    def _source_digest(self, tensor, where):
        if where is None or self.source is None:
            return None
        return self.source.record(where[0], where[1], tensor.nbytes)

    def __call__(self, got, want) -> bool:
        """bit_equal(got, want), from the digests where both are known."""
        if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.dtype == want.dtype \
                and got.shape == want.shape and got.is_contiguous() and got.nbytes:
            # one read of /proc/self/maps locates both (each read costs ~1 ms in a torch process)
            got_at, want_at = pages.file_ranges([got, want])
            written = self._written_digest(got, got_at)
            if written is not None:
                expected = self._source_digest(want, want_at) if want.is_contiguous() else None
                if expected is None:
                    expected = _tensor_digest(want)
                    self.counts["source_bytes_hashed_again"] += want.nbytes
                self.counts["bytes_from_digests"] += got.nbytes
                return written == expected
        if isinstance(got, torch.Tensor):
            self.counts["bytes_compared_by_reading"] += got.nbytes
        return equal_in_blocks(got, want)


def _tensor_digest(t, block: int = 4 << 20) -> str:
    """Digest of a tensor's bytes: pread from its file in blocks when it is memory-mapped from a registered
    file (the mapping never touched), else from memory."""
    where = pages.file_ranges([t])[0] if t.is_contiguous() else None
    if where is None:
        return hashing.digest(t.contiguous().view(-1).view(torch.uint8).numpy())
    h, buffer = hashing.new(), bytearray(min(block, t.nbytes))
    fd = os.open(where[0], os.O_RDONLY)
    try:
        for start in range(0, t.nbytes, block):
            n = min(block, t.nbytes - start)
            view = memoryview(buffer)[:n]
            pages.pread_into(fd, view, where[1] + start, where[0])
            h.update(view)
    finally:
        os.close(fd)
    return h.hexdigest()


def _same_object(a, b) -> bool:
    if hasattr(a, "getvalue") and hasattr(b, "getvalue"):  # io.BytesIO extra state (Transformer Engine)
        return a.getvalue() == b.getvalue()
    return bit_equal(a, b)


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def equal_in_blocks(a, b, block: int = 4 << 20) -> bool:
    """bit_equal for tensors, compared `block` bytes at a time: read with pread into two buffers when both
    are memory-mapped from registered checkpoint files (their mappings never touched), else with each
    block's mapped pages dropped once compared (so a large pair never sits in memory whole)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.nbytes <= block:
        return bit_equal(a, b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    sources = pages.file_ranges([a, b])
    if all(sources):
        return _equal_in_files(sources, a.nbytes, block)
    x, y = a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    for start in range(0, x.numel(), block):
        if not torch.equal(x[start:start + block], y[start:start + block]):
            return False
        pages.drop(x[start:start + block], y[start:start + block])
    return True


def _equal_in_files(sources, nbytes: int, block: int) -> bool:
    """The `nbytes` bytes at two (path, offset) places are equal, read `block` bytes at a time."""
    fds, bufs = [], [bytearray(min(block, nbytes)) for _ in sources]
    try:
        for path, _ in sources:
            fds.append(os.open(path, os.O_RDONLY))
        for start in range(0, nbytes, block):
            n = min(block, nbytes - start)
            for fd, buf, (path, offset) in zip(fds, bufs, sources):
                pages.pread_into(fd, memoryview(buf)[:n], offset + start, path)
            same = bufs[0] == bufs[1] if n == len(bufs[0]) else bufs[0][:n] == bufs[1][:n]  # memcmp
            if not same:
                return False
        return True
    finally:
        for fd in fds:
            os.close(fd)
