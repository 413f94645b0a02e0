"""Give back the resident pages of tensors memory-mapped from checkpoint files once they have been used.

`torch.load(mmap=True)` maps a file; every page a tensor touches stays in the process's RSS (counted as
file-backed memory) until the whole mapping is released. `drop` tells the kernel (madvise
MADV_DONTNEED) that those pages are not needed now: they leave RSS and, if touched again, are read back
from the page cache. Only whole pages inside mappings of files passed to `register` are dropped, never
anonymous memory (whose content MADV_DONTNEED would discard): each mapping is confirmed through
/proc/self/map_files right before the call, so a stale address is never trusted. The mapped tensors
must never be written to (they are not: the converter only reads its sources and the proxy it verifies).
"""
from __future__ import annotations

import ctypes
import os
import sys
import time

from mindspeed_proxy.proxy.core.errors import ConversionError

_MADV_DONTNEED = 4
_M_MMAP_THRESHOLD = -3
WRITE_BYTES = 4 << 20  # DropAfterWrite writes a large record (and drops its mapped pages) this many bytes at a time
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_ENABLED = sys.platform.startswith("linux")
_files: set = set()
_folders: set = set()  # the registered files' folders: a cheap test that skips other lines of /proc/self/maps
_ranges: list = []  # (start, end, path, file offset) of mappings of registered files
_last_refresh = [0.0]
REFRESH_SECONDS = 0.02  # an address outside every known mapping re-reads /proc/self/maps at most this often
_libc = None


def register(*paths: str) -> None:
    """Allow dropping pages of mappings of these files (checkpoint files that are only ever read)."""
    _files.update(os.path.realpath(p) for p in paths)
    _folders.clear()
    _folders.update(os.path.dirname(p) + "/" for p in _files)
    _last_refresh[0] = 0.0


def unregister_all() -> None:
    """Forget every registered file (end of a conversion)."""
    _files.clear()
    _folders.clear()
    _ranges.clear()


def _refresh(force: bool = False) -> None:
    now = time.monotonic()
    if not force and now - _last_refresh[0] < REFRESH_SECONDS:
        return
    _last_refresh[0] = now
    _ranges.clear()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return
    starts = set()
    for folder in _folders:  # only the lines that name a registered folder are split
        i = text.find(folder)
        while i >= 0:
            starts.add(text.rfind("\n", 0, i) + 1)
            end = text.find("\n", i)
            i = -1 if end < 0 else text.find(folder, end)
    for start in sorted(starts):
        end = text.find("\n", start)
        parts = text[start:len(text) if end < 0 else end].split(None, 5)
        if len(parts) == 6 and parts[5].strip() in _files:
            first, last = parts[0].split("-")
            _ranges.append((int(first, 16), int(last, 16), parts[5].strip(), int(parts[2], 16)))


def _mapping(start: int, end: int):
    """The registered mapping (start, end, path, file offset) holding [start, end), confirmed to still map
    that file, else None."""
    for a, b, path, offset in _ranges:
        if a <= start and end <= b:
            try:
                return (a, b, path, offset) if os.readlink(f"/proc/self/map_files/{a:x}-{b:x}") == path else None
            except OSError:
                return None
    return None


def _span(t) -> int:
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def mapped(tensor) -> bool:
    """True if `tensor`'s bytes lie in a mapping of a registered file."""
    if not _ENABLED or not _files or tensor.numel() == 0 or any(s < 0 for s in tensor.stride()):
        return False
    start, end = tensor.data_ptr(), tensor.data_ptr() + _span(tensor)
    if _mapping(start, end) is None:
        _refresh(force=True)
    return _mapping(start, end) is not None


def file_ranges(tensors) -> list:
    """For each tensor: (path, byte offset) where it starts in a registered file it is memory-mapped from
    (contiguous tensors only; its bytes can then be read with pread instead of touching the mapping), else
    None. /proc/self/maps is re-read first: an address range may since map another part of the same file."""
    if not _ENABLED or not _files:
        return [None] * len(tensors)
    _refresh(force=True)
    out = []
    for t in tensors:
        found = None
        if t.numel() and t.is_contiguous() and t.device.type == "cpu":
            found = _mapping(t.data_ptr(), t.data_ptr() + t.nbytes)
        out.append(None if found is None else (found[2], found[3] + t.data_ptr() - found[0]))
    return out


def pread_into(fd: int, target, offset: int, path: str) -> None:
    """Fill contiguous `target` (a tensor or a writable buffer) with the file's bytes at `offset`; a file
    that ends first raises ConversionError naming it."""
    if hasattr(target, "view") and hasattr(target, "numpy"):
        import torch

        target = target.view(torch.uint8).numpy()
    view = memoryview(target).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise ConversionError(f"truncated or unreadable shard: {path} ends before byte {offset + len(view)}")
        done += got


def drop_range(address: int, nbytes: int) -> None:
    """Drop the whole pages of [address, address + nbytes) if they lie in a registered file mapping."""
    if not _ENABLED or not _files or nbytes <= 0:
        return
    start = -(-address // _PAGE) * _PAGE
    end = (address + nbytes) // _PAGE * _PAGE
    if end <= start:
        return
    if _mapping(start, end) is None:
        _refresh()
        if _mapping(start, end) is None:
            return
    _load_libc().madvise(start, end - start, _MADV_DONTNEED)


def drop(*tensors) -> None:
    """Drop the resident pages of each tensor (memory-mapped from a registered file; others ignored)."""
    for t in tensors:
        if t is None or not hasattr(t, "data_ptr") or t.numel() == 0 or t.device.type != "cpu":
            continue
        if any(s < 0 for s in t.stride()):
            continue
        drop_range(t.data_ptr(), _span(t))


def drop_buffer(buffer) -> None:
    """Drop the pages under a buffer (e.g. the memoryview torch.save hands to a file's write)."""
    view = memoryview(buffer)
    if view.nbytes < _PAGE:
        return
    import numpy as np

    drop_range(np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data, view.nbytes)


class DropAfterWrite:
    """A binary file wrapper for writers that are handed memory-mapped bytes (torch.save, DCP): each write
    goes to `fh` WRITE_BYTES at a time and the pages each piece was read from (a registered source or
    scratch file) leave RSS once written. Everything else is the file's own."""

    def __init__(self, fh):
        self.fh = fh

    def write(self, data) -> int:
        """Write `data` fully, dropping each piece's pages once written."""
        view = memoryview(data)
        if not view.c_contiguous or view.nbytes <= WRITE_BYTES:
            n = self.fh.write(data)
            drop_buffer(data)
            return n
        view = view.cast("B")
        for start in range(0, len(view), WRITE_BYTES):
            piece = view[start:start + WRITE_BYTES]
            self.fh.write(piece)
            drop_buffer(piece)
        return len(view)

    def __getattr__(self, name):
        return getattr(self.fh, name)


def pin_mmap_threshold(nbytes: int = 128 << 10) -> None:
    """Fix glibc's mmap threshold (mallopt M_MMAP_THRESHOLD): every block of `nbytes` or more is its own
    mapping, returned to the kernel when freed. Without it glibc raises the threshold after the first such
    free, and later staging buffers come from the heap, where they may stay in RSS (0-16 MiB measured)."""
    libc = _load_libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, nbytes)


def _load_libc():
    global _libc
    if not _ENABLED:
        return None
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc


def trim_heap() -> None:
    """Hand the C heap's free memory back to the kernel (glibc malloc_trim) between conversion phases, so
    one phase's freed buffers do not stay in RSS under the next phase's peak."""
    libc = _load_libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)
