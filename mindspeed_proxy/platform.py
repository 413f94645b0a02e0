"""Accelerator abstraction: pick NPU, CUDA or CPU once and make megatron-core run on it.

`activate()` is the only entry point. For `cpu` it installs the transfer-to-CPU layer from
`mindspeed_proxy.patches.cpu_transfer` (the only place that remaps torch/Megatron internals), the way
torch_npu's `transfer_to_npu` remaps CUDA to NPU. For `npu` it imports torch_npu and its
`transfer_to_npu`. For `cuda` nothing is changed.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import threading

import torch

PLATFORMS = ("cuda", "npu", "cpu")
ENV_VAR = "MINDSPEED_PROXY_DEVICE"

_lock = threading.Lock()
_active: str | None = None


def _npu_importable() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        importlib.import_module("torch_npu")
    except Exception:  # a broken CANN install must not stop CPU/CUDA use
        return False
    return True


def detect() -> str:
    """Return the platform `activate(None)` would pick: env var, else npu, else cuda, else cpu."""
    name = os.environ.get(ENV_VAR, "").strip().lower()
    if name:
        if name not in PLATFORMS:
            raise ValueError(f"{ENV_VAR}={name!r} is not one of {', '.join(PLATFORMS)}")
        return name
    if _npu_importable():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def activate(name: str | None = None) -> str:
    """Activate platform `name` (cuda|npu|cpu; None = detect) once per process and return it."""
    global _active
    wanted = detect() if name is None else name.strip().lower()
    if wanted not in PLATFORMS:
        raise ValueError(f"unknown platform {name!r}: expected one of {', '.join(PLATFORMS)}")
    with _lock:
        if _active is not None:
            if _active != wanted:
                raise RuntimeError(
                    f"platform {_active!r} is already active in this process; cannot switch to {wanted!r}"
                )
            return _active
        if wanted == "npu":
            _activate_npu()
        elif wanted == "cpu":
            from mindspeed_proxy.patches import cpu_transfer

            cpu_transfer.install()
        _active = wanted
        return _active


def deactivate() -> None:
    """Undo `activate("cpu")` (the transfer-to-CPU layer's patches are reverted); cuda needs nothing undone,
    npu's transfer layer cannot be: refused."""
    global _active
    with _lock:
        if _active == "npu":
            raise RuntimeError("the npu platform (torch_npu's transfer layer) cannot be deactivated")
        if _active == "cpu":
            from mindspeed_proxy.patches import cpu_transfer

            cpu_transfer.uninstall()
        _active = None


@contextlib.contextmanager
def activated(name: str | None = None):
    """Activate platform `name` for the block if none is active, and deactivate it afterwards."""
    if _active is not None:
        yield activate(name)
        return
    chosen = activate(name)
    try:
        yield chosen
    finally:
        deactivate()


def current() -> str | None:
    """Return the active platform name, or None before `activate()`."""
    return _active


def device() -> torch.device:
    """Return the torch device of this rank on the active platform (activating by detection if needed)."""
    name = _active or activate()
    if name == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device(name, local)


def distributed_backend() -> str:
    """Return the torch.distributed backend that fits the active platform (gloo, nccl or hccl)."""
    name = _active or activate()
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[name]


def _activate_npu() -> None:
    try:
        importlib.import_module("torch_npu")
        importlib.import_module("torch_npu.contrib.transfer_to_npu")
    except ImportError as exc:
        raise RuntimeError(
            "platform 'npu' needs torch_npu (with torch_npu.contrib.transfer_to_npu); "
            f"install the Ascend CANN toolkit and torch_npu matching torch {torch.__version__}: {exc}"
        ) from exc
