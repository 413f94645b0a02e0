"""Wall and CPU time of a command and EVERY process it starts, orphans included (Linux).

`time CMD` counts only the descendants that were waited for: a multiprocessing fork server (our rank
launcher's, mindspeed_proxy/testing/launcher.py) reaps its ranks but is itself never waited for, so the CPU of
every rank it forked is missing from `time make test`. Here the process becomes a child subreaper
(prctl PR_SET_CHILD_SUBREAPER): orphaned descendants are re-parented to it and reaped, so their CPU counts.

    python benchmarks/cpu_time.py make test
"""
from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    """Run argv, reap every descendant, print wall and user+sys CPU minutes to stderr; return its exit code."""
    if not argv:
        print("usage: cpu_time.py COMMAND [ARGS...]", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"cpu_time.py: error: prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}",
              file=sys.stderr)
        return 2
    t0 = time.monotonic()
    proc = subprocess.Popen(argv)
    code = None
    while True:  # the command, then every orphan handed to us, until none is left
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid == proc.pid:
            code = os.waitstatus_to_exitcode(status)
            proc.returncode = code
    wall = time.monotonic() - t0
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = use.ru_utime + use.ru_stime
    print(f"cpu_time.py: wall {wall / 60:.2f} min, CPU {cpu / 60:.2f} min = {cpu:.1f} s (user {use.ru_utime / 60:.2f}"
          f" + sys {use.ru_stime / 60:.2f} min), {cpu / wall:.2f} cores busy on average, rc {code}", file=sys.stderr)
    return code if code is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
