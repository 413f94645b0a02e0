"""Safe reading of Megatron `.pt` files: `weights_only=True` with the globals megatron-core itself trusts.

The trusted list is megatron-core's own (`megatron/core/safe_globals.py`, megatron-core >= 0.14, which
`import megatron.core` also registers with torch for torch >= 2.6), never a copy of it. MindSpeed keeps
no such list; anything it, or any other installed package, registers with
`torch.serialization.add_safe_globals` is honoured too, as torch.load consults that registry. Full
unpickling (`trust=True`) is an explicit opt-in of the caller, never the default.
"""
from __future__ import annotations

import argparse
import io
import os
import re
import sys
import zipfile
from typing import Any

import torch

# torch's weights_only unpickler names a refused global as "Unsupported global: GLOBAL x.y ..." or, for
# modules it always blocks (os, subprocess, ...), "Trying to load unsupported GLOBAL x.y whose module ..."
_GLOBAL = re.compile(r"(?:Unsupported global: |unsupported )GLOBAL ([\w.]+)")
_DETAIL = re.compile(r"(?:WeightsUnpickler error: |\n\n\n)([^\n]+)")


class CheckpointReadError(ValueError):
    """A file that cannot be read safely; the message is one line naming the file."""


class UnsupportedGlobalError(CheckpointReadError):
    """The pickle refers to a global outside the trusted list (`name`); nothing of it was executed."""

    def __init__(self, message: str, name: str):
        super().__init__(message)
        self.name = name


class TruncatedCheckpointError(CheckpointReadError):
    """The file ends early (its zip archive is incomplete, or a record is cut short)."""


def _fallback_globals() -> list:
    """megatron-core < 0.14 ships no list: the two kinds its checkpoints hold besides tensors (the args
    namespace and numpy's RNG state arrays)."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    names = [argparse.Namespace, core.multiarray._reconstruct, np.ndarray, np.dtype]
    if hasattr(np, "dtypes") and hasattr(np.dtypes, "UInt32DType"):
        names.append(np.dtypes.UInt32DType)
    return names


def trusted_globals() -> list:
    """megatron-core's SAFE_GLOBALS (importing megatron.core also registers them with torch >= 2.6)."""
    try:
        from megatron.core.safe_globals import SAFE_GLOBALS
    except ImportError:
        return _fallback_globals()
    return list(SAFE_GLOBALS)


def _describe_failure(path: str, exc: BaseException) -> CheckpointReadError:
    text = str(exc)
    found = _GLOBAL.search(text)
    if found:
        return UnsupportedGlobalError(
            f"unsupported type {found.group(1)} in {path}: not in megatron-core's safe globals (nothing was "
            "unpickled; pass --trust-checkpoint to load it with full unpickling if you trust the file)",
            found.group(1))
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as fh:
            head = fh.read(4)
        if head == b"PK\x03\x04":
            return TruncatedCheckpointError(f"truncated file {path}: its zip archive has no central directory "
                                            f"({os.path.getsize(path)} bytes; the end of the file is missing)")
        return CheckpointReadError(f"{path}: not a torch checkpoint (not a zip archive)")
    detail = _DETAIL.search(text)
    first = detail.group(1) if detail else (text.strip().splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, EOFError):
        return TruncatedCheckpointError(f"truncated file {path}: {first}")
    return CheckpointReadError(f"{path}: cannot be read as a safe torch checkpoint ({type(exc).__name__}: {first})")


def warn_trusted(what: str) -> None:
    """One warning line on stderr: `what` is loaded with full unpickling."""
    print(f"warning: --trust-checkpoint: {what} is loaded with full unpickling (weights_only=False); a "
          "malicious checkpoint can run arbitrary code in this process", file=sys.stderr)


def safe_torch_load(path: str, map_location: str = "cpu", mmap: bool = False, trust: bool = False) -> Any:
    """Load a torch file with `weights_only=True` and megatron-core's safe globals (full unpickling only
    with `trust`); CheckpointReadError (a ValueError) with one line naming the file and the refused type."""
    if not os.path.isfile(path):
        raise CheckpointReadError(f"{path}: no such file")
    if trust:
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    # safe_globals() removes on exit what it added: pass only what is not already allowed (megatron
    # registers its list process-wide at import, which trusted_globals() may trigger: read the registry
    # after it; removing an entry megatron registered would break its own loads)
    trusted = trusted_globals()
    already = set(torch.serialization.get_safe_globals())
    extra = [g for g in trusted if g not in already]
    try:
        with torch.serialization.safe_globals(extra):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as exc:  # unknown global, truncated zip, bad magic: one clear line
        raise _describe_failure(path, exc) from None


def safe_torch_load_bytes(data: bytes, name: str, trust: bool = False) -> Any:
    """Like safe_torch_load for a torch-serialised record held in memory (e.g. inside a .distcp file)."""
    if trust:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    trusted = trusted_globals()
    already = set(torch.serialization.get_safe_globals())
    extra = [g for g in trusted if g not in already]
    try:
        with torch.serialization.safe_globals(extra):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # unknown global, cut record: one clear line
        found = _GLOBAL.search(str(exc))
        if found:
            raise UnsupportedGlobalError(
                f"unsupported type {found.group(1)} in {name}: not in megatron-core's safe globals (nothing was "
                "unpickled; pass --trust-checkpoint to load it with full unpickling if you trust the file)",
                found.group(1)) from None
        raise CheckpointReadError(f"{name}: cannot be read as a safe torch record ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
