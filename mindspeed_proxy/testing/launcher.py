"""Run a function on N gloo ranks in separate processes: free port, timeout, child tracebacks, no orphans."""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from typing import Any, Callable

from mindspeed_proxy.determinism import NUMERIC_ENV


class DistributedTestError(RuntimeError):
    """A rank raised, died or timed out; the message carries the child's traceback."""


_PRELOAD = "mindspeed_proxy.testing.preload"
_ctx: list = []  # (the fork server's context, the numeric env it started with)
# read by torch / MKL / OpenBLAS / Python when they load, i.e. once in the fork server; OMP_NUM_THREADS is left
# out: every rank runs one thread (the server imports torch with 1, _child sets 1)
_LOAD_TIME_ENV = tuple(k for k in NUMERIC_ENV if k != "OMP_NUM_THREADS")


def _context(env: dict):
    """A fork server that has imported torch and megatron-core once (mindspeed_proxy.testing.preload):
    ranks fork from it in ~0.1 s instead of spending ~5 s CPU each importing them; its process state
    never changes (nothing runs there but the imports and gc.freeze). Ranks whose numeric env
    (`_LOAD_TIME_ENV`, caller's env + `env`) differs from the server's start fresh interpreters, as does
    MINDSPEED_PROXY_SPAWN=1. Only a
    call without such overrides starts the server: started by one with them (say a pinned example's), it would
    send every later plain call of the process to fresh interpreters."""
    if os.environ.get("MINDSPEED_PROXY_SPAWN") == "1" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    wanted = {k: None if v is None else str(v) for k, v in
              ((k, env[k] if k in env else os.environ.get(k)) for k in _LOAD_TIME_ENV)}
    if not _ctx:
        if wanted != {k: os.environ.get(k) for k in _LOAD_TIME_ENV}:
            return mp.get_context("spawn")
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([_PRELOAD])
        _ctx.append((ctx, wanted))
    ctx, started_with = _ctx[0]
    return ctx if wanted == started_with else mp.get_context("spawn")


class _StdStreams:
    """The caller's file descriptors 1 and 2, handed to a rank: a forked rank would otherwise write to
    wherever the fork server's streams pointed when it started (pytest's capfd would not see it)."""

    def __init__(self, out=None, err=None):
        self.received = (out, err)

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _StdStreams, (DupFd(1), DupFd(2))

    def adopt(self) -> None:
        """In the rank: make the received descriptors its stdout and stderr."""
        for dup, fd in zip(self.received, (1, 2)):
            got = dup.detach()
            if got != fd:
                os.dup2(got, fd)
                os.close(got)


def _child(payload, rank, world_size, port, platform, caller, env, results, streams):
    streams.adopt()
    os.chdir(caller["cwd"])
    sys.path[:] = caller["path"]
    os.environ.clear()
    os.environ.update(caller["environ"])
    os.environ.update({k: str(v) for k, v in env.items()})
    # the store is already listening in the caller (torchrun's agent-store mode): every rank, rank 0
    # included, connects to it as a client, so no rank binds a port another test may have taken meanwhile
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
                      TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        fn, args, kwargs = pickle.loads(payload)  # after sys.path: fn's module may lie on a path added late
        import torch

        torch.set_num_threads(1)
        from mindspeed_proxy import platform as platform_mod

        platform_mod.activate(platform)
        _process_local_save_results()
        import torch.distributed as dist

        dist.init_process_group(platform_mod.distributed_backend(), rank=rank, world_size=world_size)
        try:
            value = fn(*args, **kwargs)
        finally:
            _teardown()
        # plain pickle: torch's ForkingPickler would share storages by fd, which dies with the child
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # every failure, SystemExit included, must reach the parent
        results.put((rank, "error", traceback.format_exc()))


def _process_local_save_results() -> None:
    """A rank's synchronous torch_dist saves pass their write results through a queue of the rank, not a spawned
    Manager interpreter that imports torch (~2.3 CPU-s per saving rank; patches/save_results_queue.py)."""
    try:
        from mindspeed_proxy.patches import save_results_queue

        save_results_queue.apply()
    except ImportError:  # no megatron-core here: nothing saves torch_dist
        pass


def _teardown():
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args, timeout: float = 300.0, platform: str = "cpu",
                    env: dict | None = None, **kwargs) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks, each its own process; return their values, by rank.

    `fn` must be importable (a module-level function). Each rank gets RANK/WORLD_SIZE/MASTER_* set,
    one torch thread, the platform activated and a process group initialised; parallel_state and
    the process group are destroyed after `fn`. Raises DistributedTestError with the first child
    traceback if any rank fails, dies or exceeds `timeout` seconds (a rank that died without a traceback
    named before the error it caused in a peer); every child is ended first.
    """
    from datetime import timedelta

    import torch.distributed as dist

    ctx = _context(env or {})
    results = ctx.Queue()
    # bound here, port 0: the OS picks a free port and it stays ours until the ranks are done (a port chosen
    # by probing and bound later by rank 0 can be taken in between by a rank of a test in another worker)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
    port = store.port
    payload = pickle.dumps((fn, args, kwargs))
    caller = {"cwd": os.getcwd(), "path": list(sys.path), "environ": dict(os.environ)}
    procs = [
        ctx.Process(target=_child, args=(payload, rank, world_size, port, platform, caller, env or {}, results,
                                         _StdStreams()), daemon=False)  # ranks may start helper processes
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistributedTestError(
                    f"{fn.__name__} timed out after {timeout:.0f}s on {world_size} ranks "
                    f"(finished ranks: {sorted(values)})"
                )
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = _died_unreported(procs, set(values), settle=0.0)
                if dead:
                    raise DistributedTestError(
                        f"rank {dead[0]} of {fn.__name__} died with exit code {procs[dead[0]].exitcode}"
                    )
                continue
            if status == "error":
                failure = f"rank {rank} of {fn.__name__} failed:\n{value}"
                # a rank that died without a word (os._exit, a signal) makes its peers fail too, e.g. in gloo's
                # connect; its death, not their consequential error, is what to report first
                dead = _died_unreported(procs, set(values) | {rank}, settle=0.5)
                if dead:
                    failure = (f"rank {dead[0]} of {fn.__name__} died with exit code {procs[dead[0]].exitcode}; "
                               f"then {failure}")
                raise DistributedTestError(failure)
            values[rank] = pickle.loads(value)
    finally:
        for proc in procs:
            proc.join(timeout=10 if len(values) == world_size else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
        results.close()
        del store
    return [values[r] for r in range(world_size)]


def _died_unreported(procs, reported: set, settle: float) -> list[int]:
    """Ranks not in `reported` that ended with a non-zero exit code, waiting up to `settle` s for one to show."""
    end = time.monotonic() + settle
    while True:
        dead = [i for i, p in enumerate(procs) if i not in reported and p.exitcode not in (None, 0)]
        if dead or time.monotonic() >= end or all(p.exitcode is not None for p in procs):
            return dead
        time.sleep(0.02)


def _python_child(argv, caller, env, out_path, err_path):
    for path, fd in ((out_path, 1), (err_path, 2)):
        got = os.open(path, os.O_WRONLY)
        os.dup2(got, fd)
        os.close(got)
    os.chdir(caller["cwd"])
    os.environ.clear()
    os.environ.update(caller["environ"])
    os.environ.update({k: str(v) for k, v in env.items()})
    code = 0
    try:
        import runpy

        if argv[0] == "-c":  # as `python -c CODE ARGS`: sys.argv[0] '-c', the current folder first on the path
            sys.path[:] = ["", *caller["path"]]
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif argv[0] == "-m":
            sys.path[:] = [caller["cwd"], *caller["path"]]
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # a script: its folder first on the path, as the interpreter puts it
            sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *caller["path"]]
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:  # what the interpreter makes of sys.exit(x)
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:  # the traceback from the command's frames on, as the interpreter prints it
        traceback.print_exception(exc.with_traceback(exc.__traceback__.tb_next))
        code = 1
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def run_python(argv: list[str], env: dict | None = None, timeout: float = 300.0, cwd: str | None = None):
    """`python ARGV` (`SCRIPT ARGS`, `-m MODULE ARGS` or `-c CODE ARGS`) in a process forked from the launcher's
    fork server, where torch and megatron-core are imported already: a fresh process with nothing patched or
    activated, in ~0.1 s instead of the ~6 CPU-s a new interpreter spends importing them.

    Returns a subprocess.CompletedProcess (exit code, stdout and stderr as text) as
    `subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=cwd)` would; raises
    subprocess.TimeoutExpired after `timeout` seconds. What differs from a new interpreter: modules imported at
    the server's start are not imported again, so what their import prints is not in stderr, and an `env`
    that the imports read (determinism.NUMERIC_ENV) starts a new interpreter instead (`_context`).
    """
    import subprocess
    import tempfile

    ctx = _context(env or {})
    caller = {"cwd": os.fspath(cwd or os.getcwd()), "path": list(sys.path), "environ": dict(os.environ)}
    with tempfile.TemporaryDirectory(prefix="run_python-") as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out_path, err_path):
            open(path, "w").close()
        proc = ctx.Process(target=_python_child, args=(list(argv), caller, env or {}, out_path, err_path))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
        with open(out_path, encoding="utf-8", errors="replace") as fh:
            out = fh.read()
        with open(err_path, encoding="utf-8", errors="replace") as fh:
            err = fh.read()
    return subprocess.CompletedProcess([sys.executable, *argv], proc.exitcode, out, err)
