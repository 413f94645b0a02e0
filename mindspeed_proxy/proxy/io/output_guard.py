"""Guard the converter's output: one conversion per --save at a time, enough free space before writing, and a
full disk during the write reported in one line.

The lock is `fcntl.flock` on `.<OUT>.proxy-lock` beside OUT_DIR, held from before planning until the proxy
is renamed into place (or given up), then removed; a second conversion to the same OUT_DIR is refused
before it writes anything. flock locks are released by the kernel when the holder dies, so a killed
conversion never leaves a stale lock (only, at worst, the empty lock file, reused by the next run).
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
from typing import Optional

from mindspeed_proxy.proxy.core.errors import ConversionError

MARGIN = 1.02  # free space asked for: the plan's output bytes x this (headers, pickles, metadata files)
_FULL = (errno.ENOSPC, errno.EDQUOT)


def lock_path(save: str) -> str:
    """`.<OUT>.proxy-lock` in OUT_DIR's parent folder."""
    parent, base = os.path.split(os.path.abspath(save))
    return os.path.join(parent, f".{base}.proxy-lock")


class OutputLock:
    """An exclusive, non-blocking lock on OUT_DIR (a context manager); ConversionError if another
    conversion holds it."""

    def __init__(self, save: str):
        self.save, self.path, self.fd = save, lock_path(save), None

    def acquire(self) -> "OutputLock":
        """Take the lock or refuse in one line naming OUT_DIR and the holder's pid."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise ConversionError(f"--save {self.save}: cannot create the lock file {self.path} "
                                      f"({exc.strerror}); nothing written") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
                os.close(fd)
                raise ConversionError(f"--save {self.save}: another conversion (pid {holder}) is writing it "
                                      f"(lock {self.path}); nothing written") from None
            try:  # the file may have been removed by the previous holder between open and flock: retry
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file and release the lock."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def device_of(path: str) -> str:
    """The filesystem holding `path`, as `<source> (<mount point>)` from /proc/self/mountinfo (else the
    st_dev numbers)."""
    real = os.path.realpath(path)
    best = None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                fields, tail = left.split(), right.split()
                if len(fields) < 5 or len(tail) < 2:
                    continue
                mount = fields[4].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and (best is None or len(mount) >= len(best[0])):
                    best = (mount, tail[1], tail[0])
    except OSError:
        pass
    if best is None:
        st = os.stat(real)
        return f"device {os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    mount, source, fstype = best
    return f"{source} ({fstype} at {mount})"


def check_free_space(save: str, needed: int) -> None:
    """Refuse in one line when OUT_DIR's filesystem has less free space than `needed` x MARGIN bytes."""
    parent = os.path.dirname(os.path.abspath(save))
    want = int(needed * MARGIN)
    free = shutil.disk_usage(parent).free
    if free < want:
        raise ConversionError(f"--save {save}: not enough free space on {device_of(parent)}: "
                              f"{want} bytes needed (the plan's {needed} x {MARGIN}), {free} bytes free; "
                              "nothing written")


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            for inner in failures.values():  # {rank: (exception, stack summary)}
                inner = inner[0] if isinstance(inner, tuple) and inner else inner
                yield from _chain(inner if isinstance(inner, BaseException) else None)
        exc = exc.__cause__ or exc.__context__


def disk_full(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a write that found the disk full: OSError ENOSPC / EDQUOT,
    torch's inline_container "unexpected pos" / "file write failed" (torch.save to a full disk), or a
    message carrying "No space left on device"."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _FULL:
            return True
        text = str(e)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        if "inline_container" in text and ("unexpected pos" in text or "file write failed" in text):
            return True
    return False


def write_error(exc: BaseException, save: str, needed: Optional[int] = None) -> Optional[ConversionError]:
    """The one-line ConversionError for a write that failed on a full disk, else None."""
    if not disk_full(exc):
        return None
    parent = os.path.dirname(os.path.abspath(save))
    try:
        free = f"{shutil.disk_usage(parent).free} bytes free now"
    except OSError:
        free = "free space unknown"
    need = f"{int(needed * MARGIN)} bytes needed, " if needed else ""
    return ConversionError(f"--save {save}: the disk filled up while writing the proxy on {device_of(parent)} "
                           f"({need}{free}); nothing written")
