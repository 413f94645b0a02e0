"""Calibration tokens for `--features outputs`: read from one of three formats, checked, fingerprinted.

Accepted `--calibration-data PATH`:
- a Megatron indexed dataset prefix (PATH.bin + PATH.idx, as written by `mindspeed_proxy.data` or
  Megatron-LM's `tools/preprocess_data.py`): documents concatenated in order and cut into sequences of
  the checkpoint's `seq_length` tokens (a last partial sequence is dropped);
- PATH.npy: an integer array [N, S] (loaded with allow_pickle=False);
- PATH.pt: an integer tensor [N, S] (loaded with weights_only=True).
At most `max_sequences` sequences (the first ones) are used; S must be <= the checkpoint's seq_length and
every id < its vocabulary size.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np
import torch

from mindspeed_proxy.proxy.core.errors import ConversionError

DEFAULT_SEQUENCES = 64


@dataclass
class Calibration:
    """The token ids used, where they came from and their fingerprints."""

    tokens: torch.Tensor  # [N, S] int64
    path: str
    format: str           # "indexed" | "npy" | "pt"
    files: dict           # {file name: sha256 of the whole file}
    fingerprint: str      # sha256 of the token ids used (int64 little-endian, row-major) and their shape

    def describe(self) -> dict:
        """JSON-able summary for the manifest."""
        n, s = self.tokens.shape
        return {"path": os.path.abspath(self.path), "format": self.format, "files_sha256": self.files,
                "tokens_sha256": self.fingerprint, "sequences": n, "sequence_length": s, "tokens": n * s}


def _error(path: str, text: str) -> ConversionError:
    return ConversionError(f"--calibration-data {path}: {text}")


def _from_indexed(prefix: str, seq_length: int, max_sequences: int) -> np.ndarray:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from mindspeed_proxy.data import validate_data_prefix

    try:
        validate_data_prefix(prefix)
    except ValueError as exc:
        raise _error(prefix, str(exc)) from None
    dataset = IndexedDataset(prefix, mmap=True)
    wanted, parts, have = max_sequences * seq_length, [], 0
    for i in range(len(dataset)):
        doc = np.asarray(dataset[i], dtype=np.int64)
        parts.append(doc[: wanted - have])
        have += len(parts[-1])
        if have >= wanted:
            break
    n = have // seq_length
    if n == 0:
        raise _error(prefix, f"holds {have} tokens, fewer than one sequence of seq_length {seq_length}")
    return np.concatenate(parts)[: n * seq_length].reshape(n, seq_length)


def _from_file(path: str) -> np.ndarray:
    try:
        if path.endswith(".npy"):
            array = np.load(path, allow_pickle=False)
        else:
            value = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(value, torch.Tensor):
                raise _error(path, f"expected a tensor [N, S] of token ids, found {type(value).__name__}")
            array = value.numpy()
    except ConversionError:
        raise
    except Exception as exc:  # a corrupt or pickled file: refuse, never execute
        first = (str(exc).strip().splitlines() or [""])[0]
        raise _error(path, f"cannot read ({type(exc).__name__}: {first})") from None
    if array.ndim != 2 or 0 in array.shape:
        raise _error(path, f"expected token ids of shape [N, S], found shape {list(array.shape)}")
    if not np.issubdtype(array.dtype, np.integer):
        raise _error(path, f"expected integer token ids, found dtype {array.dtype}")
    return array.astype(np.int64)


def read_calibration(path: str, seq_length: int, vocab_size: int,
                     max_sequences: int = DEFAULT_SEQUENCES) -> Calibration:
    """Token ids [N, S] from `path` (format from the name; see the module docstring), checked."""
    from mindspeed_proxy.proxy.io.manifest import sha256

    if max_sequences < 1:
        raise ConversionError(f"--calibration-sequences {max_sequences}: must be at least 1")
    if path.endswith((".npy", ".pt")):
        if not os.path.isfile(path):
            raise _error(path, "no such file")
        array, fmt, files = _from_file(path)[:max_sequences], path.rsplit(".", 1)[1], [path]
    else:
        if path.endswith((".bin", ".idx")):
            raise _error(path, f"pass the indexed dataset prefix without extension, e.g. {path[:-4]!r}")
        if not (os.path.isfile(path + ".bin") or os.path.isfile(path + ".idx")):
            raise _error(path, "neither a .npy / .pt file nor an indexed dataset prefix (PATH.bin / PATH.idx)")
        array, fmt, files = _from_indexed(path, seq_length, max_sequences), "indexed", [path + ".bin", path + ".idx"]
    if array.shape[1] > seq_length:
        raise _error(path, f"sequences of {array.shape[1]} tokens exceed the checkpoint's seq_length {seq_length}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        raise _error(path, f"token ids span [{low}, {high}], outside the vocabulary [0, {vocab_size - 1}]")
    array = np.ascontiguousarray(array, dtype="<i8")
    digest = hashlib.sha256(str(list(array.shape)).encode())
    digest.update(array.tobytes())
    return Calibration(tokens=torch.from_numpy(array.copy()), path=path, format=fmt,
                       files={os.path.basename(f): sha256(f) for f in files}, fingerprint=digest.hexdigest())
