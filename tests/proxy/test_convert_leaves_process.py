"""convert() leaves its process as it found it: RNG streams, megatron's RNG tracker, parallel_state, the process group,
the platform layer, the environment; glibc's mmap threshold is set by the CLI command only (fresh subprocesses)."""
import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from mindspeed_proxy.proxy.convert import convert
from mindspeed_proxy.proxy.core.options import Options

TOKENS = np.random.default_rng(0).integers(0, 256, size=(4, 64))


def _snapshot() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    from mindspeed_proxy import platform

    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state()[1].copy(), "python": random.getstate(),
            "environ": dict(os.environ), "parallel_state": ps.model_parallel_is_initialized(),
            "process group": dist.is_initialized(), "platform": platform.current(),
            "tracker object": tracker, "tracker initialised": mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED,
            "tracker states": None if tracker is None else {k: v.clone() for k, v in tracker.get_states().items()}}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (type(None), bool, str, int, float, tuple, list)):
        return a == b
    return a is b  # the tracker object itself: the caller's, not a new one


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("caller_tracker", [False, True])
def test_convert_with_calibration_forward_leaves_the_process(checkpoints, dist_checkpoints, tmp_path, fmt,
                                                            caller_tracker):
    from megatron.core.tensor_parallel import random as mrandom

    src = (checkpoints if fmt == "torch" else dist_checkpoints)("ep2_bias")
    np.save(tmp_path / "calib.npy", TOKENS)
    torch.manual_seed(123)
    np.random.seed(7)
    random.seed(9)
    saved = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    try:
        if caller_tracker:  # a caller's own tracker with one stream: kept as it is, no stream added
            from mindspeed_proxy import platform

            mrandom.initialize_rng_tracker(force_reset=True)
            with platform.activated("cpu"):  # the tracker seeds through torch.cuda's API
                mrandom._CUDA_RNG_STATE_TRACKER.add("caller-stream", 42)
        else:
            mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = None, False
        before = _snapshot()
        convert(src, str(tmp_path / "proxy"), Options(target_ep=1, target_k=4, features="outputs",
                                                       selection="reconstruction",
                                                       calibration_data=str(tmp_path / "calib.npy")),
                echo=lambda *a: None)
        after = _snapshot()
    finally:
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved
    assert os.path.isfile(tmp_path / "proxy" / "proxy_manifest.json")
    changed = [k for k in before if not _equal(before[k], after[k])]
    assert not changed, {k: (before[k], after[k]) for k in changed if k != "environ"}
    if caller_tracker:
        assert sorted(after["tracker states"]) == ["caller-stream"]


PROBE = textwrap.dedent("""
    import ctypes, json, sys
    mode, src, out = sys.argv[1:4]
    if mode == "api":
        from mindspeed_proxy.proxy.convert import convert
        from mindspeed_proxy.proxy.core.options import Options
        convert(src, out, Options(target_ep=1, target_k=4), echo=lambda *a: None)
    elif mode == "cli":
        from mindspeed_proxy.proxy.cli import main
        assert main(["--load", src, "--save", out, "--target-expert-parallel-size", "1",
                     "--target-num-experts", "4"]) == 0
    libc = ctypes.CDLL(None)
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc.mallinfo2.restype = Info
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # glibc's dynamic threshold rises past 4 MiB once a 4 MiB mapping is freed, so the next 1 MiB block comes
    # from the heap; a pinned threshold (mallopt M_MMAP_THRESHOLD) keeps mapping it
    libc.free(libc.malloc(4 << 20))
    before = libc.mallinfo2().hblks
    block = libc.malloc(1 << 20)
    pinned = libc.mallinfo2().hblks > before
    libc.free(block)
    print(json.dumps({"pinned": pinned}))
""")


def test_mmap_threshold_set_by_the_command_only(checkpoints, tmp_path):
    if sys.platform != "linux":
        pytest.skip("glibc's mallinfo2 / mallopt")
    src = checkpoints("ep2_bias")
    found = {}
    for mode in ("none", "api", "cli"):
        res = subprocess.run([sys.executable, "-c", PROBE, mode, src, str(tmp_path / mode)], capture_output=True,
                             text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert res.returncode == 0, res.stderr[-2000:]
        found[mode] = json.loads(res.stdout.strip().splitlines()[-1])["pinned"]
    # the probe sees a pinned threshold (the command), none in a fresh process, none after convert()
    assert found == {"none": False, "api": False, "cli": True}, found


EAGER_PROBE = textwrap.dedent("""
    import json, sys
    import torch
    compile_ = torch.compile
    from mindspeed_proxy.proxy.cli import main
    assert main(["--load", sys.argv[1], "--save", sys.argv[2], "--target-expert-parallel-size", "1",
                 "--target-num-experts", "4"]) == 0
    from megatron.core.transformer.moe.router import TopKRouter
    print(json.dumps({"megatron imported by the command": "megatron.core.dist_checkpointing" in sys.modules,
                      "inductor": any(m.startswith("torch._inductor") for m in sys.modules),
                      "router compiled": hasattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable"),
                      "torch.compile given back": torch.compile is compile_}))
""")


def test_command_imports_megatron_core_with_eager_fused_functions(dist_checkpoints, tmp_path):
    """A torch_dist conversion imports megatron-core under feature eager-jit (patches/eager_jit.py): its fused
    functions stay plain, torch._inductor is never imported, and torch.compile is torch's again afterwards."""
    res = subprocess.run([sys.executable, "-c", EAGER_PROBE, dist_checkpoints("ep2_bias"), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {
        "megatron imported by the command": True, "inductor": False, "router compiled": False,
        "torch.compile given back": True}
