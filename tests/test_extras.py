"""A missing optional dependency: one line naming the extra, exit 2, no traceback, nothing written (one test per extra)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mindspeed_proxy.extras import MissingExtra, require

REPO = Path(__file__).resolve().parents[1]


def run_hidden(hidden: list, code: str, cwd) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter in which importing any of `hidden` fails as if it were not installed."""
    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in hidden)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def cli(argv: list) -> str:
    return f"from mindspeed_proxy.cli import main\nsys.exit(main({argv!r}))\n"


def one_line(proc, extra: str, package: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, lines
    assert f"pip install 'mindspeed-proxy[{extra}]'" in lines[0] and package in lines[0], lines[0]
    return lines[0]


def test_report_without_matplotlib_or_markdown_it(tmp_path):
    for module, package in (("matplotlib", "matplotlib"), ("markdown_it", "markdown-it-py")):
        out = tmp_path / f"out-{module}"
        proc = run_hidden([module], cli(["report", str(tmp_path), "--out", str(out)]), tmp_path)
        line = one_line(proc, "report", package)
        assert line.startswith("mindspeed-proxy report: error: ")
        assert not out.exists()


def test_compare_without_scipy(tmp_path):
    one_line(run_hidden(["scipy"], cli(["compare", str(tmp_path), str(tmp_path)]), tmp_path), "report", "scipy")


def test_calibrate_yaml_out_without_pyyaml(tmp_path):
    out = tmp_path / "cal.yaml"
    proc = run_hidden(["yaml"], cli(["calibrate", str(tmp_path), "--false-alarms-per-1000-steps", "5",
                                     "--out", str(out)]), tmp_path)
    assert "--out" in one_line(proc, "yaml", "pyyaml")
    assert not out.exists()


def test_yaml_monitor_config_without_pyyaml_is_a_value_error(tmp_path):
    path = tmp_path / "monitor.yaml"
    path.write_text("interval: 5\n")
    proc = run_hidden(["yaml"], f"""
        from mindspeed_proxy.monitor.config import MonitorConfig
        try:
            MonitorConfig.read_file({str(path)!r})
        except ValueError as exc:
            print(exc, file=sys.stderr)
            sys.exit(2)
        """, tmp_path)
    assert str(path) in one_line(proc, "yaml", "pyyaml")


def test_trainer_tensorboard_dir_without_tensorboard(tmp_path):
    tb = tmp_path / "tb"
    proc = run_hidden(["tensorboard"], cli(["train", "--train-iters", "20", "--tensorboard-dir", str(tb),
                                            "--log-dir", str(tmp_path / "logs")]), tmp_path)
    assert "--tensorboard-dir" in one_line(proc, "tensorboard", "tensorboard")
    assert not tb.exists()


def test_converter_hf_source_without_safetensors(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    out = tmp_path / "out"
    proc = run_hidden(["safetensors"], f"""
        from mindspeed_proxy.proxy.cli import main
        sys.exit(main(["--load", {str(src)!r}, "--save", {str(out)!r}, "--target-expert-parallel-size", "1",
                       "--target-num-experts", "4"]))
        """, tmp_path)
    line = one_line(proc, "hf", "safetensors")
    assert line.startswith("convert_to_proxy.py: error: ") and str(src) in line
    assert not out.exists()


def test_deepspeed_example_without_deepspeed(tmp_path):
    work = tmp_path / "work"
    proc = run_hidden(["deepspeed"], f"""
        import runpy
        sys.argv = ["deepspeed_moe.py", "--quick", "--work-dir", {str(work)!r}]
        runpy.run_path({str(REPO / "examples" / "deepspeed_moe.py")!r}, run_name="__main__")
        """, tmp_path)
    assert one_line(proc, "deepspeed", "deepspeed").startswith("deepspeed_moe: ")
    assert not work.exists()


def test_require_returns_the_module_and_names_the_extra():
    assert require("json", "a test") is json
    with pytest.raises(MissingExtra, match=r"^X needs the no_such_pkg_xyz package, which is not installed "
                                           r"\(pip install no_such_pkg_xyz\)$"):
        require("no_such_pkg_xyz", "X")
    with pytest.raises(MissingExtra, match=r"pip install 'mindspeed-proxy\[proxy\]'"):
        require("no_such_pkg_xyz.sub", "X", extra="proxy")


def test_a_broken_install_is_not_renamed_a_missing_extra(tmp_path):
    pkg = tmp_path / "brokenpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import no_such_dependency_xyz\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ModuleNotFoundError) as info:
            require("brokenpkg", "X")
        assert not isinstance(info.value, MissingExtra) and info.value.name == "no_such_dependency_xyz"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("brokenpkg", None)
