#!/usr/bin/env python
"""Convert a Megatron MoE checkpoint into a proxy with fewer experts at a smaller EP (see docs/proxy.md)."""
import sys

from mindspeed_proxy.proxy.cli import main

if __name__ == "__main__":
    sys.exit(main())
