"""pytest plugin: CPU seconds of every test, its rank processes included, and the slowest files and tests by CPU.

`--durations` gives wall seconds, which on a loaded machine say little, and `time pytest` misses the ranks of
run_distributed: they are forked by multiprocessing's fork server, which reaps them and is never waited for.
Per test this sums the CPU (user + sys) of the test process, of its waited-for children (torchrun trees,
spawned ranks) and of the fork server with the ranks it reaped (/proc/PID/stat). `--cpu-durations=N` prints
the totals and the N most expensive files and tests; with pytest-xdist the workers send their numbers along
with the test reports.
"""
from __future__ import annotations

import os
import resource
from collections import defaultdict

import pytest

_KEY = "cpu_s"
_start = pytest.StashKey[float]()
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _forkserver_cpu() -> float:
    """CPU seconds of the launcher's fork server and of the ranks it has reaped (0 when none runs)."""
    import multiprocessing.forkserver

    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return sum(int(x) for x in fields[11:15]) / _TICK  # utime stime cutime cstime


def process_tree_cpu() -> float:
    """CPU seconds so far of this process, its waited-for children and the fork server's ranks."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _forkserver_cpu()


def pytest_addoption(parser):
    """--cpu-durations=N."""
    parser.getgroup("terminal reporting").addoption(
        "--cpu-durations", type=int, default=None, metavar="N",
        help="print the total CPU seconds of the tests (rank processes included) and the N most expensive "
             "files and tests by CPU (0: all)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Mark where the test's CPU starts (before its setup)."""
    item.stash[_start] = process_tree_cpu()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach the test's CPU seconds (setup to teardown) to its teardown report."""
    outcome = yield
    if call.when == "teardown" and _start in item.stash:
        outcome.get_result().user_properties.append((_KEY, process_tree_cpu() - item.stash[_start]))



class _Collected:
    def __init__(self):
        self.cpu, self.wall = {}, defaultdict(float)

    def pytest_runtest_logreport(self, report):
        """Collect each test's CPU (teardown report) and wall (all phases)."""
        self.wall[report.nodeid] += report.duration
        if report.when == "teardown":
            for key, value in report.user_properties:
                if key == _KEY:
                    self.cpu[report.nodeid] = value

    def pytest_terminal_summary(self, terminalreporter):
        """The totals, then the N most expensive files and tests by CPU."""
        n = terminalreporter.config.getoption("cpu_durations")
        if not self.cpu:
            return
        tr = terminalreporter
        files = defaultdict(lambda: [0.0, 0.0, 0])
        for nodeid, cpu in self.cpu.items():
            f = files[nodeid.split("::")[0]]
            f[0], f[1], f[2] = f[0] + cpu, f[1] + self.wall[nodeid], f[2] + 1
        total_cpu, total_wall = sum(self.cpu.values()), sum(self.wall[k] for k in self.cpu)
        tr.write_sep("=", f"CPU of the tests: {total_cpu / 60:.1f} min (rank processes included) in "
                          f"{total_wall / 60:.1f} min of test wall time, {len(self.cpu)} tests")
        top = sorted(files.items(), key=lambda kv: -kv[1][0])
        for path, (cpu, wall, count) in top[:n or None]:
            tr.write_line(f"{cpu:8.1f} CPU-s {wall:8.1f} s wall {count:4d} tests  {path}")
        tr.write_sep("-", "tests by CPU")
        for nodeid, cpu in sorted(self.cpu.items(), key=lambda kv: -kv[1])[:n or None]:
            tr.write_line(f"{cpu:8.1f} CPU-s {self.wall[nodeid]:8.1f} s wall  {nodeid}")


def pytest_configure(config):
    """Register the collector where the report is printed (the xdist controller, or the only process)."""
    if config.getoption("cpu_durations") is not None and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Collected(), "cpu-report-collector")
