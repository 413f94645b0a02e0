"""`python -m mindspeed_proxy.patches --list`: the patch table and what applies to the imported megatron-core."""
import argparse
import sys

from mindspeed_proxy.patches import cpu_transfer, eager_jit, fault_patches, mla_local, monitor_patches
from mindspeed_proxy.patches.registry import (MEGATRON_CORE_SUPPORTED, applies, megatron_core_version, resolve, table,
                                              within)


def main(argv=None) -> int:
    """Print the registry table with a status column for the imported megatron-core."""
    parser = argparse.ArgumentParser(prog="python -m mindspeed_proxy.patches", description=__doc__)
    parser.add_argument("--list", action="store_true", help="print the patch table")
    args = parser.parse_args(argv)
    if not args.list:
        parser.print_help()
        return 0
    eager_jit.register_all()
    cpu_transfer._register_all()
    monitor_patches.register_all()
    fault_patches.register_all()
    mla_local.register_all()
    version = megatron_core_version()
    supported = version is not None and within(version, MEGATRON_CORE_SUPPORTED)
    print(f"megatron-core {version} ({'supported' if supported else 'not supported'}: "
          f"mindspeed-proxy supports {MEGATRON_CORE_SUPPORTED})")
    print(f"{'feature':<18} {'target':<62} {'versions':<22} {'status'}")
    for patch in table():
        if not applies(patch):
            status = "not for this version"
        else:
            try:
                resolve(patch.target)
                status = "applies"
            except (ImportError, AttributeError):
                status = "target absent (optional)" if patch.optional else "target absent"
        print(f"{patch.feature:<18} {patch.target:<62} {patch.versions or 'any':<22} {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
