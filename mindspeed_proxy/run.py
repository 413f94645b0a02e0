"""Launcher: `torchrun ... -m mindspeed_proxy.run SCRIPT.py <its flags> [--enable-mechanism-monitor ...]`.

Activates the accelerator platform (env MINDSPEED_PROXY_DEVICE=cuda|npu|cpu, else auto-detected: on
a machine without CUDA or NPU this installs the transfer-to-CPU layer, so Megatron-LM's own scripts
run on CPU with gloo), applies the mindspeed-proxy patches (the monitor is enabled when
--enable-mechanism-monitor is among the flags), then runs SCRIPT as `__main__` with the same argv,
so an unmodified Megatron-LM / MindSpeed-LLM / example script trains with the monitor on.
Megatron-LM's own parser learns our flags through the patched `parse_args`. On the CPU platform a flag
that needs an accelerator (CUDA graphs, unified memory, offloading: `mindspeed_proxy.cpu_flags`) is
refused in one line, exit 2, before the platform is activated.
"""
import os
import runpy
import sys

from mindspeed_proxy.cli import fail


def apply_from_argv(argv: list[str]) -> None:
    """Apply the patches, enabling the monitor if `argv` carries --enable-mechanism-monitor."""
    from mindspeed_proxy import patches
    from mindspeed_proxy.monitor.arguments import monitor_config_from_args, monitor_flags_in

    flags = monitor_flags_in(argv)
    config = monitor_config_from_args(flags) if flags.enable_mechanism_monitor else None
    patches.apply(config, enable_monitor=flags.enable_mechanism_monitor, faults=flags.inject_fault)
    from mindspeed_proxy.patches.rl_replay_args import apply_routing_replay

    from mindspeed_proxy.patches.rl_sampling_seed import apply_sampling_seed

    apply_routing_replay(flags)  # again on Megatron-LM's parsed args (patched parse_args)
    apply_sampling_seed(flags)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m mindspeed_proxy.run`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        fail("mindspeed_proxy.run", f"{script}: no such script")
    from mindspeed_proxy.patches.registry import UnsupportedVersionError

    try:
        from mindspeed_proxy import platform
        from mindspeed_proxy.cpu_flags import refusal

        if platform.detect() == "cpu" and (reason := refusal(argv[1:])):
            fail("mindspeed_proxy.run", reason)
        platform.activate()
        apply_from_argv(argv[1:])
    except UnsupportedVersionError as exc:  # its message is one line naming the version and the range
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None
    except ValueError as exc:
        fail("mindspeed_proxy.run", exc)
    sys.argv = [script] + argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
