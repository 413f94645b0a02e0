"""The library never imports test or example code: no module under mindspeed_proxy/ outside testing/ imports
mindspeed_proxy.testing or examples (module level or inside a function)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mindspeed_proxy"
FORBIDDEN = ("mindspeed_proxy.testing", "examples")


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _offenders() -> list:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "testing":
            continue
        for name in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
                found.append(f"{path.relative_to(PACKAGE.parent)}: {name}")
    return found


def test_library_imports_no_test_or_example_code():
    assert _offenders() == []


def test_the_scan_sees_function_local_imports(tmp_path, monkeypatch):
    """The scan catches what used to be there: a function-local `from mindspeed_proxy.testing.parallel import`."""
    module = tmp_path / "mindspeed_proxy" / "training"
    module.mkdir(parents=True)
    (module / "loop.py").write_text("def f():\n    from mindspeed_proxy.testing.parallel import init_parallel\n")
    (tmp_path / "mindspeed_proxy" / "testing").mkdir()
    (tmp_path / "mindspeed_proxy" / "testing" / "x.py").write_text("import mindspeed_proxy.testing\n")
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path / "mindspeed_proxy")
    assert _offenders() == ["mindspeed_proxy/training/loop.py: mindspeed_proxy.testing.parallel",
                            "mindspeed_proxy/training/loop.py: mindspeed_proxy.testing.parallel.init_parallel"]
