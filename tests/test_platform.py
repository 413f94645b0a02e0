"""Platform selection and the transfer-to-CPU layer (each case that activates runs in its own process: forked by
run_python from the launcher's fork server, which imported torch and megatron-core and activated nothing)."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mindspeed_proxy.testing import run_python


PROBE = str(Path(__file__).with_name("numerics_probe.py"))


def run_py(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_python(["-c", code], env=env, timeout=180)


def test_activate_is_idempotent_and_refuses_a_switch():
    proc = run_py(
        "from mindspeed_proxy import platform as p\n"
        "assert p.current() is None\n"
        "assert p.activate('cpu') == 'cpu' and p.activate('cpu') == 'cpu' and p.current() == 'cpu'\n"
        "from mindspeed_proxy.patches import registry\n"
        "n = len(registry.applied()); p.activate('cpu'); assert len(registry.applied()) == n\n"
        "try:\n    p.activate('cuda')\nexcept RuntimeError as e:\n    print('refused', e)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "refused" in proc.stdout and "'cpu' is already active" in proc.stdout


def test_env_var_selects_platform_and_bad_value_is_named():
    ok = run_py("from mindspeed_proxy import platform as p; print(p.activate())",
                env={"MINDSPEED_PROXY_DEVICE": "cpu"})
    assert ok.returncode == 0 and ok.stdout.strip() == "cpu", ok.stderr
    bad = run_py("from mindspeed_proxy import platform as p; p.activate()",
                 env={"MINDSPEED_PROXY_DEVICE": "tpu"})
    assert bad.returncode != 0 and "MINDSPEED_PROXY_DEVICE='tpu'" in bad.stderr


def test_detect_without_accelerators_picks_cpu():
    proc = run_py("from mindspeed_proxy import platform as p; print(p.detect())",
                  env={"MINDSPEED_PROXY_DEVICE": ""})
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert proc.stdout.strip() == expected


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("torch_npu") is not None,
                    reason="torch_npu is installed here, so the missing-package error cannot occur")
def test_npu_without_torch_npu_is_a_clear_error():
    proc = run_py("from mindspeed_proxy import platform as p; p.activate('npu')")
    assert proc.returncode != 0
    assert "platform 'npu' needs torch_npu" in proc.stderr


def test_cpu_layer_remaps_cuda_requests():
    proc = run_py(
        "import torch\nfrom mindspeed_proxy import platform as p\np.activate('cpu')\n"
        "a = torch.empty(3, device='cuda'); b = torch.zeros(2, device=torch.cuda.current_device())\n"
        "c = torch.ones(2).cuda(); d = torch.ones(2).to('cuda:0'); e = a.new_zeros(4, device='cuda')\n"
        "assert all(t.device.type == 'cpu' for t in (a, b, c, d, e))\n"
        "assert torch.ones(1).type() == 'torch.cuda.FloatTensor'\n"
        "assert torch.ones(1, dtype=torch.bfloat16).type() == 'torch.cuda.BFloat16Tensor'\n"
        "assert torch.ones(1, dtype=torch.int64).type() == 'torch.LongTensor'\n"
        "assert torch.ones(2).type(torch.float64).dtype == torch.float64\n"
        "s = torch.cuda.current_stream(); s.wait_stream(torch.cuda.Stream())\n"
        "with torch.cuda.stream(s):\n    pass\n"
        "torch.cuda.synchronize(); torch.cuda.nvtx.range_push('x'); torch.cuda.nvtx.range_pop()\n"
        "print('ok')\n"
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_rng_tracker_forks_the_cpu_generator():
    proc = run_py(
        "import os, torch\nfrom mindspeed_proxy import platform as p\np.activate('cpu')\n"
        "torch.distributed.init_process_group('gloo', store=torch.distributed.HashStore(), rank=0, world_size=1)\n"
        "from mindspeed_proxy.testing import init_parallel\ninit_parallel(seed=5)\n"
        "from megatron.core import tensor_parallel\n"
        "torch.manual_seed(0); plain = torch.rand(4); after = torch.rand(4)\n"
        "torch.manual_seed(0); first = torch.rand(4)\n"
        "with tensor_parallel.get_cuda_rng_tracker().fork():\n    inside = torch.rand(4)\n"
        "rest = torch.rand(4)\n"
        "assert torch.equal(first, plain) and torch.equal(rest, after)\n"
        "assert not torch.equal(inside, after)\n"
        "gen = torch.Generator().manual_seed(5 + 2718); expected = torch.rand(4, generator=gen)\n"
        "assert torch.equal(inside, expected), (inside, expected)\n"
        "assert torch.equal(torch.cuda.get_rng_state(), torch.get_rng_state())\n"
        "print('ok')\n"
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_layer_does_not_change_numerics():
    """What unpatched megatron-core can run on a CPU-only torch (the dense MLP) is bit-identical."""
    results = []
    for use_layer in ("0", "1"):
        proc = run_python([PROBE, use_layer, "0"], timeout=180)
        assert proc.returncode == 0, proc.stderr
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert results[0] == results[1]
    assert results[0]["grads"], "the probe produced no gradients"


def test_grouped_gemm_fallback_matches_per_expert_matmul():
    from mindspeed_proxy.patches.cpu_transfer import CPUGroupedGemmOps

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(10, 6, generator=gen, dtype=torch.float64)
    b = torch.randn(3, 6, 5, generator=gen, dtype=torch.float64)
    sizes = torch.tensor([4, 0, 6])
    out = CPUGroupedGemmOps.gmm(a, b, sizes)
    expected = torch.cat([a[:4] @ b[0], a[4:10] @ b[2]])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out_t = CPUGroupedGemmOps.gmm(a, b.transpose(1, 2).contiguous(), sizes, trans_b=True)
    torch.testing.assert_close(out_t, expected, rtol=1e-12, atol=1e-12)


def test_registry_skips_a_row_written_for_other_megatron_lines():
    """A row gated to other megatron-core lines is left out; the rows of the imported line apply."""
    import math

    from mindspeed_proxy.patches import registry

    rows = [registry.register(registry.Patch("math:tau", lambda orig: -1.0, "test-version-gate", versions="<0.1")),
            registry.register(registry.Patch("math:e", lambda orig: orig, "test-version-gate"))]
    try:
        assert registry.apply_feature("test-version-gate") == ["math:e"]
        assert math.tau > 6 and "math:tau" not in registry.applied()
    finally:
        assert registry.revert_feature("test-version-gate") == ["math:e"]
        for row in rows:  # one feature owns a target: leave the table as it was
            registry._REGISTRY.remove(row)


def test_device_contexts_still_work_under_the_cpu_layer():
    """`with torch.device("meta")` after the layer is installed (transformers' from_pretrained relies on it)."""
    code = ("import torch\nfrom mindspeed_proxy import platform\nplatform.activate('cpu')\n"
            "with torch.device('meta'):\n    t = torch.empty(3)\n    m = torch.nn.Linear(2, 2)\n"
            "assert t.is_meta and m.weight.is_meta, (t.device, m.weight.device)\n"
            "assert torch.empty(3, device='cuda').device.type == 'cpu'\nprint('ok')")
    proc = run_py(code)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr


def test_deactivate_gives_every_original_back():
    """activate('cpu') then deactivate(): each patched attribute is the original object again (or absent again),
    and a later activate() patches afresh."""
    proc = run_py(
        "import torch, megatron.core.tensor_parallel.random as r\n"
        "from mindspeed_proxy import platform as p\n"
        "from mindspeed_proxy.patches import registry\n"
        "before = {'empty': torch.empty, 'cur': torch.cuda.current_device, 'rng': r._set_cuda_rng_state}\n"
        "with p.activated('cpu'):\n"
        "    assert torch.empty is not before['empty'] and r._set_cuda_rng_state is not before['rng']\n"
        "    assert torch.empty(2, device='cuda').device.type == 'cpu' and registry.applied()\n"
        "assert p.current() is None and registry.applied() == []\n"
        "assert torch.empty is before['empty'] and torch.cuda.current_device is before['cur']\n"
        "assert r._set_cuda_rng_state is before['rng']\n"
        "p.activate('cpu'); assert torch.empty is not before['empty']; print('ok')\n"
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr


_JIT_PROBE = (
    "import sys, torch\n"
    "compile_ = torch.compile\n"
    "{activate}"
    "from megatron.core.transformer.moe.router import TopKRouter\n"
    "from megatron.core.fusions.fused_bias_swiglu import bias_swiglu\n"
    "compiled = [hasattr(f, '_torchdynamo_orig_callable') for f in (TopKRouter._apply_expert_bias, bias_swiglu)]\n"
    "x = torch.randn(3, 8, dtype=torch.float64); b = torch.randn(8, dtype=torch.float64)\n"
    "y = (x + b).chunk(2, -1); ref = torch.nn.functional.silu(y[0]) * y[1]\n"
    "same = bool(torch.equal(bias_swiglu(x, b), ref)) if not any(compiled) else None\n"
    # torch's optimizers import torch._dynamo and part of torch._inductor (its config) on their first construction;
    # inductor's compiler (compile_fx) is imported only when a function is traced and built
    "print({{'compiled': compiled, 'inductor': 'torch._inductor.compile_fx' in sys.modules,\n"
    "       'same': same, 'compile_is_torchs': torch.compile is compile_}})\n"
)


def test_cpu_platform_runs_megatron_jit_functions_eager_in_a_new_interpreter():
    """Activated before megatron-core is imported (every CLI of ours), the `torch:compile` row leaves megatron-core's
    `jit_fuser` functions plain (inductor's compiler never imported, no C++ build on their first call), with the result of their
    own torch ops; without the platform they are dynamo-compiled (what the row changes)."""
    results = {}
    for name, activate in (("cpu", "from mindspeed_proxy import platform\nplatform.activate('cpu')\n"), ("none", "")):
        proc = subprocess.run([sys.executable, "-c", _JIT_PROBE.format(activate=activate)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        results[name] = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert results["cpu"] == {"compiled": [False, False], "inductor": False, "same": True, "compile_is_torchs": False}
    assert results["none"]["compiled"] == [True, True]  # not called: its first call would build it (~12 CPU-s)


def test_fork_server_imports_megatron_as_the_cpu_platform_does_and_leaves_torch_compile_alone():
    """The launcher's fork server (mindspeed_proxy.testing.preload) imported megatron-core with the eager row, so a
    forked rank never builds inductor kernels, and `torch.compile` is torch's own again in it."""
    proc = run_py(_JIT_PROBE.format(activate=""))
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert got == {"compiled": [False, False], "inductor": False, "same": True, "compile_is_torchs": True}
