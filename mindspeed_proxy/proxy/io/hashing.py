"""Streaming hashes of the converter: the source files read once (hashed as the buffers arrive), digests of
every tensor record of a legacy source, and digests of the bytes written.

The hash is XXH3-128 (the `xxhash` package, several GB/s per core) when installed, else SHA-256 (hashlib).
Both are used only to compare bytes the converter itself read and wrote, and to record the source files'
digests in the manifest under the algorithm's name; the manifest's other fingerprints (calibration data,
usage and features files: small files) stay SHA-256.
"""
from __future__ import annotations

import hashlib
import os
import queue
import threading
from typing import Optional

from mindspeed_proxy.proxy.core.errors import ConversionError

try:
    import xxhash as _xxhash
except ImportError:  # the `proxy` extra installs it; SHA-256 is the slower fallback
    _xxhash = None

ALGORITHM = "xxh3_128" if _xxhash is not None else "sha256"
BLOCK = 4 << 20  # bytes read per block by the source pass
BUFFERS = 3  # blocks in flight between the reading thread and the hash thread (12 MiB in all)


def new(algorithm: str = ALGORITHM):
    """A fresh streaming hasher (update / hexdigest) of `algorithm`."""
    if algorithm == "xxh3_128":
        if _xxhash is None:
            raise ConversionError("xxh3_128 digests need the xxhash package (pip install xxhash)")
        return _xxhash.xxh3_128()
    return hashlib.new(algorithm)


def digest(data, algorithm: str = ALGORITHM) -> str:
    """Hex digest of a bytes-like object."""
    h = new(algorithm)
    h.update(data)
    return h.hexdigest()


def file_digest(path: str, algorithm: str = ALGORITHM, block: int = BLOCK) -> str:
    """Hex digest of a whole file, read in blocks."""
    h = new(algorithm)
    buffer = bytearray(block)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def torch_records(path: str) -> dict:
    """{(file offset, size): record name} of the tensor storages (`*/data/*` records) of a torch.save zip
    file, from its central directory (no tensor byte is read); {} for a file that is not one."""
    try:
        import torch

        reader = torch._C.PyTorchFileReader(path)
        out = {}
        for name in reader.get_all_records():
            if name.startswith("data/"):
                out[(reader.get_record_offset(name), reader.get_record_size(name))] = name
        return out
    except Exception:  # not a zip written by torch.save (legacy pickle, .distcp, json): whole-file digest only
        return {}


class SourcePass:
    """Reads every source file once, sequentially in BLOCK-byte buffers, on a reading thread that hands each
    filled buffer to a hash thread (file reads and both hashes release the GIL): the whole-file digest for
    the manifest and the digest of every tensor record (what verification compares the written stream
    against). `records`: True for torch.save files (spans from their zip directory), a callable
    path -> [(offset, size)] (torch_dist chunks), or False. Started before planning; result() waits."""

    def __init__(self, paths: list, records=True, block: int = BLOCK):
        self.files: dict = {}      # path -> hex digest of the file
        self.records: dict = {}    # (real path, offset, size) -> hex digest of that tensor record
        self._error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._free: queue.Queue = queue.Queue()
        self._full: queue.Queue = queue.Queue()
        for _ in range(BUFFERS):
            self._free.put(bytearray(block))
        self._paths, self._want_records = list(paths), records
        self._reader = threading.Thread(target=self._read, daemon=True, name="proxy-source-read")
        self._hasher = threading.Thread(target=self._hash, daemon=True, name="proxy-source-hash")
        self._hasher.start()
        self._reader.start()

    def _read(self) -> None:
        try:
            for path in self._paths:
                if callable(self._want_records):
                    spans = sorted(set(self._want_records(path)))
                else:
                    spans = sorted(torch_records(path)) if self._want_records else []
                self._full.put(("file", path, spans))
                with open(path, "rb", buffering=0) as fh:
                    while not self._stop.is_set():
                        buffer = self._free.get()
                        n = fh.readinto(buffer)
                        if not n:
                            self._free.put(buffer)
                            break
                        self._full.put(("data", buffer, n))
                self._full.put(("end", path, None))
                if self._stop.is_set():
                    break
        except BaseException as exc:  # reported by result()
            self._error = exc
        finally:
            self._full.put(("stop", None, None))

    def _hash(self) -> None:
        path, whole, spans, at, open_spans = None, None, [], 0, []
        try:
            while True:
                kind, item, extra = self._full.get()
                if kind == "stop":
                    return
                if kind == "file":
                    item = os.path.realpath(item)
                    path, whole, spans, at, open_spans = item, new(), list(extra), 0, []
                elif kind == "data":
                    view = memoryview(item)[:extra]
                    whole.update(view)
                    end = at + extra
                    while spans and spans[0][0] < end:  # records starting in this block
                        offset, size = spans.pop(0)
                        open_spans.append([offset, size, new()])
                    still = []
                    for span in open_spans:
                        offset, size, h = span
                        lo, hi = max(offset, at), min(offset + size, end)
                        if hi > lo:
                            h.update(view[lo - at:hi - at])
                        if offset + size <= end:
                            self.records[(path, offset, size)] = h.hexdigest()
                        else:
                            still.append(span)
                    open_spans = still
                    at = end
                    self._free.put(item)
                elif kind == "end":  # records past the end of a truncated file get no digest
                    if not self._stop.is_set():
                        self.files[item] = whole.hexdigest()
        except BaseException as exc:
            self._error = exc
            while True:  # keep the reader from blocking on a full queue
                kind, item, _ = self._full.get()
                if kind == "data":
                    self._free.put(item)
                if kind == "stop":
                    return

    def result(self) -> dict:
        """{path: hex digest} once every file is read; ConversionError if a file could not be read."""
        self._reader.join()
        self._hasher.join()
        if self._error is not None:
            raise ConversionError(f"reading the source failed: {self._error}")
        return self.files

    def record(self, path: str, offset: int, size: int) -> Optional[str]:
        """Digest of the tensor record at `offset` of `size` bytes in source `path` (after result()), or None."""
        return self.records.get((os.path.realpath(path), offset, size))

    def cancel(self) -> None:
        """Stop reading (at the next block) and wait for both threads."""
        self._stop.set()
        self._reader.join()
        self._hasher.join()
