"""Test artifacts built once per test run, also when pytest-xdist spreads the tests over worker processes."""
from __future__ import annotations

import os
import shutil
from typing import Callable

from mindspeed_proxy.locking import file_lock


def shared_dir(tmp_path_factory, name: str) -> str:
    """A folder named `name` that every pytest-xdist worker of this run sees (a fresh tmp folder without xdist)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return str(tmp_path_factory.mktemp(name))
    # each worker's base temp is <run>/popen-gwN; their parent is the run's, common to all workers
    path = tmp_path_factory.getbasetemp().parent / name
    path.mkdir(exist_ok=True)
    return str(path)


def built_once(path: str, build: Callable[[], object]) -> str:
    """Run `build()` (which writes `path`) unless a finished build of `path` exists; return `path`.

    A file lock beside `path` makes concurrent callers wait for the one that builds; a build that raised
    leaves no marker, so the next caller removes what it wrote and builds again.
    """
    marker = path + ".built"  # beside, not inside: tests hash and list the folder
    with file_lock(path + ".lock"):
        if not os.path.exists(marker):
            shutil.rmtree(path, ignore_errors=True)  # a failed build's partial output must not be resumed
            build()
            open(marker, "w").close()
    return path
