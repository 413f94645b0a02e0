"""publish(): published reports and results.json carry no machine-specific absolute paths."""
import json
from types import SimpleNamespace

from mindspeed_proxy.experiments.publish import publish, relative_paths


def test_relative_paths_rewrites_only_paths_under_root(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    text = f"{root}/runs/a and {root} and {root}line and /tmp/x"
    assert relative_paths(text, root) == f"runs/a and . and {root}line and /tmp/x"


def test_publish_writes_no_root_path(tmp_path):
    root = tmp_path / "repo"
    run_dir = root / "runs" / "r1"
    (run_dir / "mechanism_monitor").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    rep = tmp_path / "reports" / "r1"
    rep.mkdir(parents=True)
    (rep / "summary.md").write_text(f"# Run report: `{run_dir}`\n")
    (rep / "summary.json").write_text(json.dumps({"run_dir": str(run_dir)}))
    (rep / "summary.html").write_text(f"<title>{run_dir}</title>")
    (rep / "loss.png").write_bytes(b"\x89PNG" + str(run_dir).encode())  # binary: copied as is
    dest = publish([SimpleNamespace(name="r1", run_dir=run_dir)], tmp_path / "reports", tmp_path / "out",
                   {"argv": [str(root / ".venv/bin/python"), str(root / "examples/x.py")]}, {}, root=root)
    for name in ("summary.md", "summary.json", "summary.html"):
        assert str(root) not in (dest / "r1" / name).read_text()
    assert json.loads((dest / "r1" / "summary.json").read_text())["run_dir"] == "runs/r1"
    assert json.loads((dest / "results.json").read_text())["argv"] == [".venv/bin/python", "examples/x.py"]
    assert (dest / "r1" / "loss.png").read_bytes() == (rep / "loss.png").read_bytes()
    assert (dest / "raw" / "r1.metrics.jsonl.gz").is_file()
