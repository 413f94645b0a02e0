"""Reports of every run (`mindspeed-proxy report`), copies of their plots and raw JSONL into a results
folder, and results.json."""
from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

from mindspeed_proxy.report.report import make_report

REPO_ROOT = Path(__file__).resolve().parents[2]


def relative_paths(text: str, root=REPO_ROOT) -> str:
    """`text` with every absolute path under `root` written relative to it (no machine paths in docs)."""
    root = str(Path(root).resolve()).rstrip("/")
    return re.sub(re.escape(root) + r"(?![\w.-])", ".", text.replace(root + "/", ""))


def reports(results: list, out_root, rule=None, heatmaps: bool = False, dpi: int = 60) -> dict:
    """`make_report` of each run into `out_root/<run>/` (loss + aggregate plots at `dpi`; heatmaps optional)."""
    out = {}
    for r in results:
        kwargs = {} if rule is None else {"rule": rule}
        out[r.name] = make_report(r.run_dir, Path(out_root) / r.name, heatmaps=heatmaps, dpi=dpi, **kwargs)
    return out


def publish(results: list, report_root, dest, data: dict, extra: dict, root=REPO_ROOT) -> Path:
    """Copy each run's report (plots and summaries) and its gzipped raw JSONL into `dest`, paths relative to `root`."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    raw = dest / "raw"
    raw.mkdir(exist_ok=True)
    for r in results:
        src, run_out = Path(report_root) / r.name, dest / r.name
        shutil.rmtree(run_out, ignore_errors=True)
        run_out.mkdir()
        for p in src.iterdir():
            if p.suffix in (".md", ".json", ".html"):
                (run_out / p.name).write_text(relative_paths(p.read_text(), root))
            elif p.suffix == ".png":
                shutil.copy2(p, run_out / p.name)
        for kind, path in (("metrics", Path(r.run_dir) / "metrics.jsonl"),
                           ("monitor", Path(r.run_dir) / "mechanism_monitor" / "monitor.jsonl")):
            if path.is_file():
                with open(path, "rb") as fi, gzip.open(raw / f"{r.name}.{kind}.jsonl.gz", "wb", compresslevel=9) as fo:
                    shutil.copyfileobj(fi, fo)
    (dest / "results.json").write_text(relative_paths(json.dumps({**data, **extra}, indent=1, default=str), root) + "\n")
    return dest
