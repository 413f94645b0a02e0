"""`mindspeed-proxy replay RUN_DIR [--mechanism-monitor-config FILE]`: a run's alerts under another detector config."""
from __future__ import annotations

import argparse
import json
import sys

from mindspeed_proxy.cli import error
from mindspeed_proxy.monitor.detectors import FAMILIES
from mindspeed_proxy.report.runs import RunError, layer_label, load_run


def main(argv=None) -> int:
    """Entry point of `replay`: print the alerts per family (or JSON); exit 2 on a bad run dir or config."""
    parser = argparse.ArgumentParser(prog="mindspeed-proxy replay", description=__doc__)
    parser.add_argument("run_dir")
    parser.add_argument("--mechanism-monitor-config", default=None,
                        help="MonitorConfig file (JSON/YAML); default: the config recorded in the run")
    parser.add_argument("--json", action="store_true", help="print every alert as a JSON line")
    args = parser.parse_args(argv)
    from mindspeed_proxy.monitor.config import MonitorConfig
    from mindspeed_proxy.report.replay import replay_alerts

    try:
        run = load_run(args.run_dir)
        if not run.samples:
            raise RunError(f"{args.run_dir}: no monitor samples (mechanism_monitor/monitor.jsonl missing or empty)")
        if args.mechanism_monitor_config:
            config = MonitorConfig.from_file(args.mechanism_monitor_config)
        else:
            config = MonitorConfig.from_dict(run.config)
    except (RunError, ValueError, TypeError) as exc:
        return error("mindspeed-proxy replay", exc)
    alerts = replay_alerts(run, config)
    if args.json:
        for alert in alerts:
            print(json.dumps(alert))
        return 0
    for family in [f for f in FAMILIES if f in config.families]:
        hits = [a for a in alerts if a["family"] == family]
        first = min(hits, key=lambda a: a["step"]) if hits else None
        where = (f"first at step {first['step']} ({first['metric']}, {layer_label(first['layer'])}, {first['kind']})"
                 if first else "none")
        print(f"{family:<19} {len(hits):3d} alert(s), {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
