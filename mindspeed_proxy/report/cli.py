"""`mindspeed-proxy report RUN_DIR [--out DIR]` and `mindspeed-proxy compare RUN_A RUN_B`."""
from __future__ import annotations

import argparse
import json
import sys

from mindspeed_proxy.cli import error
from mindspeed_proxy.extras import MissingExtra, require
from mindspeed_proxy.report.runs import RunError, load_run


def main(argv=None) -> int:
    """Entry point of `report`: write plots and the summary; exit 2 on a bad run dir (nothing written)."""
    parser = argparse.ArgumentParser(prog="mindspeed-proxy report", description=__doc__)
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="output folder (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:  # before anything is written
        require("matplotlib", "mindspeed-proxy report")
        require("markdown_it", "mindspeed-proxy report")
    except MissingExtra as exc:
        return error("mindspeed-proxy report", exc)
    try:
        load_run(args.run_dir)  # validate before creating anything
    except RunError as exc:
        return error("mindspeed-proxy report", exc)
    from mindspeed_proxy.report.report import make_report

    summary = make_report(args.run_dir, args.out)
    print((__import__("pathlib").Path(summary["out_dir"]) / "summary.md").read_text())
    print(f"report written to {summary['out_dir']}")
    return 0


def compare_main(argv=None) -> int:
    """Entry point of `compare`: print the consistency table; exit 2 on a bad run dir."""
    parser = argparse.ArgumentParser(prog="mindspeed-proxy compare", description=__doc__)
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    args = parser.parse_args(argv)
    try:
        require("scipy.stats", "mindspeed-proxy compare")
    except MissingExtra as exc:
        return error("mindspeed-proxy compare", exc)
    try:
        a, b = load_run(args.run_a), load_run(args.run_b)
    except RunError as exc:
        return error("mindspeed-proxy compare", exc)
    from mindspeed_proxy.report.compare import compare_runs, format_table

    result = compare_runs(a, b)
    print(json.dumps(result, indent=2, default=str) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
