"""`mindspeed-proxy COMMAND ...`: the console entry point."""
import sys

COMMANDS = {
    "convert": ("mindspeed_proxy.proxy.cli", "prune a Megatron MoE checkpoint into a proxy (convert_to_proxy.py)"),
    "plan": ("mindspeed_proxy.proxy.plan_cli", "proxy options of a real model on a cluster (--hf-config / --load / "
             "Megatron flags)"),
    "patches": ("mindspeed_proxy.patches.__main__", "list the patch registry (--list)"),
    "report": ("mindspeed_proxy.report.cli", "plots + summary of a run dir (RUN_DIR [--out DIR])"),
    "compare": ("mindspeed_proxy.report.compare_cli", "consistency of two run dirs (RUN_A RUN_B)"),
    "replay": ("mindspeed_proxy.report.replay_cli", "a run's alerts under another detector config (RUN_DIR)"),
    "calibrate": ("mindspeed_proxy.report.calibrate_cli",
                  "detector thresholds from healthy runs (RUN_DIR... --false-alarms-per-1000-steps R --out FILE)"),
}


def main(argv=None) -> int:
    """Dispatch `argv[0]` to its command's main(argv[1:])."""
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print("usage: mindspeed-proxy {" + ",".join(COMMANDS) + "} ...", file=sys.stderr)
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<10} {help_text}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
