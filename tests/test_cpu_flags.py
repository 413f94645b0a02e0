"""Flags that cannot run on the CPU platform: refused by the launcher in one line, exit 2, before anything runs."""
from __future__ import annotations

import subprocess
import sys

import pytest

from mindspeed_proxy.cpu_flags import REFUSED, refusal


@pytest.mark.parametrize("argv, flag", [
    (["--cuda-graph-impl", "local"], "--cuda-graph-impl local"),
    (["--cuda-graph-impl=transformer_engine"], "--cuda-graph-impl transformer_engine"),
    (["--enable-cuda-graph"], "--enable-cuda-graph"),
    (["--inference-dynamic-batching-unified-memory-level", "1"], "--inference-dynamic-batching-unified-memory-level 1"),
    (["--rl-offload-kv-cache-during-training"], "--rl-offload-kv-cache-during-training"),
    (["--no-rl-training-cuda-graphs", "--rl-training-cuda-graphs"], "--rl-training-cuda-graphs"),
    (["--refit-method", "gloo", "--refit-method", "nccl"], "--refit-method nccl"),
    (["--lr", "1", "--rl-offload-optimizer-during-inference"], "--rl-offload-optimizer-during-inference"),
])
def test_refused(argv, flag):
    """The reason names the flag as given (value included) and the cause."""
    reason = refusal(argv)
    assert reason is not None and reason.startswith(f"{flag} cannot run on the CPU platform: ")


@pytest.mark.parametrize("argv", [
    [],
    ["--cuda-graph-impl", "none"],
    ["--cuda-graph-impl", "local", "--cuda-graph-impl", "none"],
    ["--inference-dynamic-batching-unified-memory-level", "0"],
    ["--rl-offload-kv-cache-during-training", "--no-rl-offload-kv-cache-during-training"],
    ["--refit-method", "gloo"],
    ["--inference-dynamic-batching-num-cuda-graphs", "1"],  # inert without --cuda-graph-impl
])
def test_allowed(argv):
    """Off, default or last-overridden settings pass."""
    assert refusal(argv) is None


def test_every_rule_refuses_its_own_flag():
    """Each table row refuses the flag it names (so none is dead)."""
    for rule in REFUSED:
        argv = [rule.flag] if rule.on is None else [rule.flag, rule.on[0]]
        assert refusal(argv).startswith(argv[0]), rule


def test_launcher_refuses_before_running(tmp_path):
    """`python -m mindspeed_proxy.run SCRIPT --cuda-graph-impl local` on CPU: one line, exit 2, script not run."""
    script = tmp_path / "script.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    res = subprocess.run([sys.executable, "-m", "mindspeed_proxy.run", str(script), "--cuda-graph-impl", "local"],
                         env={"MINDSPEED_PROXY_DEVICE": "cpu", "PATH": "/usr/bin:/bin",
                              "PYTHONPATH": ":".join(p for p in sys.path if p)},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "mindspeed_proxy.run: error: --cuda-graph-impl local cannot run on the CPU platform: "
        "CUDA graphs capture CUDA kernels; the CPU platform runs eager torch"]
    assert not marker.exists()
