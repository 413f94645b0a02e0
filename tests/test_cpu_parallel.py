"""The CPU platform's answers for TP>1 / CP>1 / SP (patches/cpu_parallel.py); no Megatron-LM needed.

Megatron-LM's `validate_args` asks `torch.cuda.get_device_capability()` (grouped GEMM needs >= 8) and,
at TP>1 or CP>1, `get_device_arch_version()`: below 10 it requires CUDA_DEVICE_MAX_CONNECTIONS=1, at
10 and above it turns on Blackwell-only stream groups. megatron-core's local-spec torch norm refuses
`sequence_parallel`, which MoE at TP>1 requires.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from mindspeed_proxy.patches import cpu_parallel
from test_platform import run_py

ARCH_TARGETS = {
    "megatron.training.utils:get_device_arch_version",  # core_v0.12-0.17
    "megatron.training.utils.common_utils:get_device_arch_version",  # core_v0.18+
    "megatron.training.arguments:get_device_arch_version",  # the name validate_args calls
}


def test_device_queries_answer_what_megatron_lm_accepts():
    """Capability and arch version are one device, 8.0: grouped GEMM accepted (>= 8), below FP8's 8.9
    and Blackwell's 10; torch's own get_device_properties is left raising (inductor reads that as no CUDA)."""
    proc = run_py(
        "import torch\n"
        "props = torch.cuda.get_device_properties\n"
        "from mindspeed_proxy import platform as p; p.activate('cpu')\n"
        "from mindspeed_proxy.patches import cpu_parallel, registry\n"
        "dc = torch.cuda.get_device_capability()\n"
        "arch = cpu_parallel._arch_version(None)()\n"
        "assert dc == (8, 0) and dc[0] >= 8 and dc < (8, 9) and arch == dc[0] < 10, (dc, arch)\n"
        "assert torch.cuda.get_device_properties is props\n"
        "try:\n    torch.cuda.get_device_properties(0)\nexcept (AssertionError, RuntimeError):\n    print('raises')\n"
        "rows = {r.target: r for r in registry.table() if r.feature == 'cpu-platform'}\n"
        "print(sorted(t for t in rows if t.endswith(':get_device_arch_version')))\n"
        "print(rows['megatron.training.arguments:get_device_arch_version'].versions)\n",
        env={"MINDSPEED_PROXY_DEVICE": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "raises"
    assert eval(lines[1]) == sorted(ARCH_TARGETS)  # noqa: S307 - our own printed list
    assert lines[2].startswith(">=")  # version-gated like every Megatron-LM row


@pytest.mark.parametrize("args, preset, expected", [
    (dict(tensor_model_parallel_size=2), None, "1"),
    (dict(context_parallel_size=2), None, "1"),
    (dict(), None, None),
    (dict(tensor_model_parallel_size=2, use_megatron_fsdp=True), None, None),  # FSDP requires it unset / > 1
    (dict(tensor_model_parallel_size=2, use_torch_fsdp2=True), None, None),
    (dict(tensor_model_parallel_size=2), "8", "8"),  # the user's own value is kept
])
def test_validate_args_sees_one_hardware_queue(monkeypatch, args, preset, expected):
    """validate_args runs with CUDA_DEVICE_MAX_CONNECTIONS=1 at TP/CP>1 unless FSDP or the user says otherwise."""
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    if preset is not None:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", preset)
    seen = []

    def validate_args(ns, defaults={}):
        seen.append(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
        return ns

    ns = SimpleNamespace(**{**dict(tensor_model_parallel_size=1, context_parallel_size=1, use_torch_fsdp2=False,
                                   use_megatron_fsdp=False), **args})
    assert cpu_parallel._one_hardware_queue(validate_args)(ns, {}) is ns
    assert seen == [expected]


def test_local_norm_accepts_sequence_parallel_and_marks_its_parameters():
    """Under SP megatron-core's WrappedTorchNorm builds the same torch norm, parameters marked for the TP
    grad sum (finalize_model_grads); without SP it is the untouched original; its other checks still hold."""
    proc = run_py(
        "import torch\n"
        "from mindspeed_proxy import platform as p; p.activate('cpu')\n"
        "from megatron.core.transformer import TransformerConfig\n"
        "from megatron.core.transformer.torch_norm import WrappedTorchNorm\n"
        "def cfg(**kw):\n"
        "    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, **kw)\n"
        "x = torch.randn(5, 8)\n"
        "for norm_name, cls in (('RMSNorm', torch.nn.RMSNorm), ('LayerNorm', torch.nn.LayerNorm)):\n"
        "    sp = cfg(normalization=norm_name, sequence_parallel=True, tensor_model_parallel_size=2)\n"
        "    norm = WrappedTorchNorm(sp, 8, eps=1e-6)\n"
        "    assert type(norm) is cls and sp.sequence_parallel, (type(norm), sp.sequence_parallel)\n"
        "    params = list(norm.parameters())\n"
        "    assert params and all(getattr(q, 'sequence_parallel', False) for q in params)\n"
        "    torch.manual_seed(0); torch.nn.init.normal_(params[0])\n"
        "    ref = cls(8, eps=1e-6); ref.load_state_dict(norm.state_dict())\n"
        "    assert torch.equal(norm(x), ref(x))\n"
        "    plain = WrappedTorchNorm(cfg(normalization=norm_name), 8)\n"
        "    assert type(plain) is cls and not any(hasattr(q, 'sequence_parallel') for q in plain.parameters())\n"
        "try:\n"
        "    WrappedTorchNorm(cfg(sequence_parallel=True, tensor_model_parallel_size=2,"
        " layernorm_zero_centered_gamma=True), 8)\n"
        "except AssertionError as e:\n"
        "    print('refused:', e)\n",
        env={"MINDSPEED_PROXY_DEVICE": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: zero_centered_gamma not supported by torch LayerNorm" in proc.stdout
