"""Safe reading of Megatron `.pt` files: `weights_only=True` plus an explicit allowlist, never raw unpickling."""
from __future__ import annotations

import argparse
import io
import os
from typing import Any

import numpy as np
import torch


def _numpy_globals() -> list:
    names = []
    multiarray = getattr(np, "_core", None) or np.core
    names.append(multiarray.multiarray._reconstruct)
    names.append(np.ndarray)
    names.append(np.dtype)
    for attr in ("UInt32DType", "Float64DType", "Float32DType", "Int64DType"):
        if hasattr(np, "dtypes") and hasattr(np.dtypes, attr):
            names.append(getattr(np.dtypes, attr))
    return names


def allowlist() -> list:
    """Classes a Megatron checkpoint may legitimately pickle besides tensors and builtins."""
    return [argparse.Namespace, *_numpy_globals()]


def safe_torch_load(path: str, map_location: str = "cpu", mmap: bool = False) -> Any:
    """Load a torch file with `weights_only=True` and our allowlist; ValueError names a bad file."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file")
    # safe_globals() removes on exit what it added: pass only what is not already allowed (megatron
    # registers argparse.Namespace process-wide at import; removing it would break its own loads)
    already = set(torch.serialization.get_safe_globals())
    extra = [g for g in allowlist() if g not in already]
    try:
        with torch.serialization.safe_globals(extra):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as exc:  # truncated zip, unknown global, bad magic: one clear line
        raise ValueError(f"{path}: cannot be read as a safe torch checkpoint ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc


def safe_torch_load_bytes(data: bytes, name: str) -> Any:
    """Like safe_torch_load for a torch-serialised record held in memory (e.g. inside a .distcp file)."""
    already = set(torch.serialization.get_safe_globals())
    extra = [g for g in allowlist() if g not in already]
    try:
        with torch.serialization.safe_globals(extra):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # unknown global, cut record: one clear line
        raise ValueError(f"{name}: cannot be read as a safe torch record ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
