"""`mindspeed-proxy compare RUN_A RUN_B`: module entry for the CLI dispatcher."""
from mindspeed_proxy.report.cli import compare_main as main

__all__ = ["main"]
