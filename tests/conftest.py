"""Leak guard: a test that leaves a patch applied, a process group or parallel_state alive, the platform layer
switched on, or a rank process running in the pytest process fails, so no state reaches the tests after it.
Also the file order for pytest-xdist (mindspeed_proxy/testing/schedule.py) and the --cpu-durations report."""
import multiprocessing.forkserver
import multiprocessing.resource_tracker

import psutil
import pytest

from mindspeed_proxy.testing.schedule import expensive_first

pytest_plugins = ("mindspeed_proxy.testing.cpu_report",)  # --cpu-durations=N

# Files that cost more than ~25 CPU-s, most first: `make test --cpu-durations=0` on 2 cores (rank processes
# included). `make test` runs them first (--no-loadscope-reorder), each whole on one worker.
EXPENSIVE_FILES = ("tests/test_fault_matrix.py", "tests/rl/test_rl_loop.py", "tests/test_trainer.py",
                   "tests/test_platform.py", "tests/test_patches.py", "tests/proxy/test_proxy_layouts.py",
                   "tests/proxy/test_proxy_dist.py", "tests/proxy/test_proxy_workers_guard.py",
                   "tests/proxy/test_proxy_legacy.py", "tests/test_determinism.py", "tests/rl/test_rl_resume.py")


def pytest_collection_modifyitems(items):
    """The expensive files first (see EXPENSIVE_FILES)."""
    expensive_first(items, EXPENSIVE_FILES)


def _state() -> dict:
    import torch.distributed as dist

    from mindspeed_proxy import platform
    from mindspeed_proxy.patches import registry

    try:
        from megatron.core import parallel_state

        model_parallel = parallel_state.model_parallel_is_initialized()
    except ImportError:
        model_parallel = False
    return {"patches applied": registry.applied(), "process group": dist.is_available() and dist.is_initialized(),
            "parallel_state": model_parallel, "platform": platform.current()}


def _helper_pids() -> set:
    """The launcher's fork server and multiprocessing's resource tracker: long-lived by design."""
    pids = {getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
            getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)}
    return {p for p in pids if p}


def _live_children() -> list:
    helpers = _helper_pids()
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid not in helpers and child.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{child.pid} {' '.join(child.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.fixture(autouse=True)
def no_leaked_state():
    """Fail the test that changed process-wide state (compared with the state before it) or left processes."""
    before = _state()
    yield
    after = _state()
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    leftovers = _live_children()
    problems = [f"{k}: {b!r} -> {a!r}" for k, (b, a) in changed.items()]
    problems += [f"process still running: {c}" for c in leftovers]
    if problems:
        pytest.fail("test leaked process-wide state (tests/conftest.py guard):\n  " + "\n  ".join(problems),
                    pytrace=False)
