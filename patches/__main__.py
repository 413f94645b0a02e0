"""`python -m mindspeed_proxy.patches --list`: the patch table and what applies to the installed versions."""
import argparse
import sys

from mindspeed_proxy.patches import cpu_transfer, fault_patches, monitor_patches
from mindspeed_proxy.patches.registry import applies, megatron_core_version, resolve, table


def main(argv=None) -> int:
    """Print the registry table with an 'applies' column for the installed megatron-core."""
    parser = argparse.ArgumentParser(prog="python -m mindspeed_proxy.patches", description=__doc__)
    parser.add_argument("--list", action="store_true", help="print the patch table")
    args = parser.parse_args(argv)
    if not args.list:
        parser.print_help()
        return 0
    cpu_transfer._register_all()
    monitor_patches.register_all()
    fault_patches.register_all()
    version = megatron_core_version()
    print(f"megatron-core {version}")
    print(f"{'feature':<18} {'target':<62} {'versions':<16} {'status'}")
    for patch in table():
        if not applies(patch):
            status = "unsupported version"
        else:
            try:
                resolve(patch.target)
                status = "applies"
            except (ImportError, AttributeError):
                status = "target absent (optional)" if patch.optional else "target absent"
        print(f"{patch.feature:<18} {patch.target:<62} {patch.versions or 'any':<16} {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
