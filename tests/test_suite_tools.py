"""The suite's own tools: the xdist file order, the per-test CPU count (ranks included), benchmarks/cpu_time.py."""
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from mindspeed_proxy.testing import run_distributed
from mindspeed_proxy.testing.cpu_report import process_tree_cpu
from mindspeed_proxy.testing.schedule import expensive_first

REPO = Path(__file__).resolve().parents[1]
BURN = 0.6  # CPU seconds each process below spends


def burn(seconds: float = BURN) -> float:
    """Spin on the CPU for `seconds` of this process's CPU time; return what it used."""
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass
    return time.process_time() - start


def test_expensive_files_first_then_the_rest_in_collection_order():
    ids = ["t/a.py::x", "t/b.py::x", "t/a.py::y", "t/c.py::x", "t/d.py::x", "t/c.py::y", "t/d.py::y"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    expensive_first(items, ("t/d.py", "t/b.py", "t/missing.py"))
    assert [i.nodeid for i in items] == ["t/d.py::x", "t/d.py::y", "t/b.py::x", "t/a.py::x", "t/a.py::y",
                                         "t/c.py::x", "t/c.py::y"]


def test_cpu_count_includes_the_forked_ranks():
    """The ranks of run_distributed are reaped by the fork server, never by this process: still counted."""
    before, own = process_tree_cpu(), time.process_time()
    used = run_distributed(burn, 2)
    spent, own = process_tree_cpu() - before, time.process_time() - own
    assert min(used) >= BURN
    assert spent >= own + sum(used) * 0.9, (spent, own, used)


ORPHANS = f"""
import os, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_suite_tools import burn
if os.fork() == 0:          # child: leaves a grandchild behind and exits at once
    if os.fork() == 0:
        burn(); os._exit(0)
    os._exit(0)
os.wait()
burn()
"""


def test_cpu_time_counts_orphaned_descendants():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cpu_time.py"), sys.executable, "-c", ORPHANS],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    cpu_s = float(line.split(" min = ")[1].split(" s ")[0])
    assert cpu_s >= 2 * BURN * 0.95, line  # the orphan's CPU too, which `time` would not see
    bad = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cpu_time.py")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("usage:")
