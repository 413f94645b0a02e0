"""The megatron-core version gate: it reads the imported `megatron.core`, refuses in one line, gates rows per line."""
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from packaging.version import Version

from mindspeed_proxy.patches import cpu_transfer, fault_patches, monitor_patches, registry, save_results_queue

REPO = Path(__file__).resolve().parents[1]


def fake_core(root: Path, major: int, minor: int, patch: int, vcs_suffix: bool = False) -> Path:
    """A `megatron/core` package whose package_info says MAJOR.MINOR.PATCH (0.18+ style: git-suffixed __version__)."""
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("raise ImportError('the gate must refuse before importing megatron.core')\n")
    info = f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ''\n"
    info += "VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)\n__version__ = '.'.join(map(str, VERSION[:3]))\n"
    if vcs_suffix:
        info += "__version__ += '+' + 'abc1234'\n"
    (core / "package_info.py").write_text(info)
    return root


def run_python(args, pythonpath: Path, cwd: Path):
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "MINDSPEED_PROXY_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


def test_the_gate_reads_the_imported_package_info_not_the_distribution(tmp_path):
    """A checkout on PYTHONPATH over the venv's wheel: the version is the checkout's (0.18+ VCS suffix dropped)."""
    fake_core(tmp_path, 0, 19, 1, vcs_suffix=True)
    code = ("from importlib.metadata import version\nfrom mindspeed_proxy.patches import registry\n"
            "print(version('megatron-core'), registry.megatron_core_version())")
    proc = run_python(["-c", code], tmp_path, tmp_path)
    assert proc.returncode == 0, proc.stderr
    installed, imported = proc.stdout.split()
    assert imported == "0.19.1" and installed != imported


def test_launcher_refuses_an_unsupported_core_in_one_line(tmp_path):
    """The real entry point, before any megatron import: one line naming the version and the range, exit 2."""
    fake_core(tmp_path / "mlm", 0, 21, 0)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    proc = run_python(["-m", "mindspeed_proxy.run", str(script), "--enable-mechanism-monitor"], tmp_path / "mlm",
                      tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "megatron-core 0.21.0" in lines[0] and registry.MEGATRON_CORE_SUPPORTED in lines[0]
    assert str(tmp_path / "mlm" / "megatron" / "core") in lines[0]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the refusal is for Pythons older than 0.17+ needs")
def test_launcher_refuses_a_newer_core_on_an_older_python(tmp_path):
    """A core_v0.19 checkout over a Python 3.11 venv: one line naming the core, the Python it needs and this one."""
    fake_core(tmp_path / "mlm", 0, 19, 1, vcs_suffix=True)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    proc = run_python(["-m", "mindspeed_proxy.run", str(script)], tmp_path / "mlm", tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    python = ".".join(map(str, sys.version_info[:3]))
    assert "megatron-core 0.19.1" in lines[0] and f"needs Python >=3.12, this is Python {python}" in lines[0]


def test_an_imported_package_info_module_wins(monkeypatch):
    """Once megatron.core is imported, its package_info module is what counts."""
    fake = types.ModuleType("megatron.core.package_info")
    fake.MAJOR, fake.MINOR, fake.PATCH, fake.PRE_RELEASE = 0, 11, 0, "rc1"
    monkeypatch.setitem(sys.modules, "megatron.core.package_info", fake)
    assert registry.megatron_core_version() == Version("0.11.0rc1")
    with pytest.raises(registry.UnsupportedVersionError) as info:
        registry.check_supported()
    message = str(info.value)
    assert "\n" not in message and "megatron-core 0.11.0rc1" in message and registry.MEGATRON_CORE_SUPPORTED in message
    row = registry.register(registry.Patch("math:inf", lambda orig: orig, "test-gate-refusal"))
    try:
        with pytest.raises(registry.UnsupportedVersionError):
            registry.apply_feature("test-gate-refusal")
        assert "math:inf" not in registry.applied()
    finally:
        registry._REGISTRY.remove(row)


def all_rows():
    cpu_transfer._register_all()
    monitor_patches.register_all()
    fault_patches.register_all()
    save_results_queue.register_all()
    return [p for p in registry.table() if p.feature in (cpu_transfer.FEATURE, monitor_patches.FEATURE,
                                                         fault_patches.FEATURE, fault_patches.LOWP_FEATURE,
                                                         save_results_queue.FEATURE)]


def test_every_row_for_the_imported_version_resolves():
    """Each non-optional row written for the imported megatron-core finds its target there (none is missing)."""
    version = registry.check_supported()
    rows = [p for p in all_rows() if registry.applies(p, version)]
    missing = []
    for patch in rows:
        if patch.optional:
            continue
        try:
            owner, attr, value = registry.resolve(patch.target)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{patch.target}: {exc}")
            continue
        if value is registry._MISSING:
            missing.append(patch.target)
    assert not missing, f"megatron-core {version}: {missing}"
    assert len(rows) > 40


@pytest.mark.parametrize("version,absent", [
    ("0.16.1", {"megatron.rl.rl_utils:compute_logprobs_batch"}),  # was _compute_logprobs_batch before 0.17
    ("0.17.1", {"megatron.core.transformer.moe.grouped_gemm_util:grouped_gemm",
                "megatron.core.transformer.moe.grouped_gemm_util:ops", "megatron.legacy.fused_kernels:load",
                "megatron.rl.rl_utils:_compute_logprobs_batch"}),
    ("0.19.1", {"megatron.core.transformer.moe.grouped_gemm_util:grouped_gemm",
                "megatron.core.transformer.moe.grouped_gemm_util:ops", "megatron.legacy.fused_kernels:load",
                "megatron.training.initialize:parse_args", "megatron.rl.rl_utils:_compute_logprobs_batch",
                # present, but 0.19 offsets the sampling seed by the data-parallel rank itself
                "megatron.core.inference.text_generation_controllers.text_generation_controller:"
                "TextGenerationController.__init__"}),
])
def test_rows_whose_targets_left_a_line_are_not_applied_there(version, absent):
    """The rows gated off a line are exactly those whose targets are gone from its Megatron-LM tag (or, named
    above, whose behaviour the line has itself)."""
    rows = all_rows()
    assert {p.target for p in rows if not registry.applies(p, Version(version))} == absent
