"""Which top-level checkpoint fields the proxy keeps."""
from __future__ import annotations

from mindspeed_proxy.proxy.core.options import Options


def kept_fields(fields, options: Options) -> tuple:
    """The top-level checkpoint fields the proxy keeps: `fields` less `opt_param_scheduler` unless
    --keep-optimizer-args (optimizer, RNG and rerun state are never in `fields`)."""
    return tuple(f for f in fields if options.keep_optimizer_args or f != "opt_param_scheduler")
