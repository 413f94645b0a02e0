"""The one inter-process lock of the project: an exclusive advisory lock on a lock file (POSIX flock).

Used where independent processes build the same thing once (the dataset index cache in data.py, the test
checkpoints pytest-xdist workers share in testing/shared.py). The lock goes with the file descriptor, so a
process that dies releases it.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Iterator


@contextlib.contextmanager
def file_lock(path) -> Iterator[None]:
    """Hold an exclusive lock on file `path` (created if absent, never truncated) for the block."""
    fd = os.open(os.fspath(path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
