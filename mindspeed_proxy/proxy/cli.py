"""`convert_to_proxy.py` / `mindspeed-proxy convert`: command-line front end of the converter."""
from __future__ import annotations

import argparse
import sys
import warnings
from typing import Optional

from mindspeed_proxy.proxy.errors import ConversionError


def build_parser(prog: str = "convert_to_proxy.py") -> argparse.ArgumentParser:
    """The converter's flags."""
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False, description=(
        "Build a proxy of a Megatron MoE checkpoint: keep one representative expert per cluster, at a "
        "smaller expert-parallel size."))
    p.add_argument("--load", required=True, metavar="CKPT_DIR")
    p.add_argument("--save", metavar="OUT_DIR", help="required unless --dry-run")
    p.add_argument("--target-expert-parallel-size", type=int, required=True, metavar="EP2")
    p.add_argument("--target-num-experts", type=int, required=True, metavar="K")
    p.add_argument("--iteration", type=int, default=None, help="default: the tracker's iteration")
    p.add_argument("--features", default="weights", help="weights (data-free) | outputs | FILE")
    p.add_argument("--cluster", choices=["agglomerative", "kmeans"], default="agglomerative")
    p.add_argument("--representative", choices=["medoid", "usage"], default="medoid")
    p.add_argument("--calibration-data", default=None, metavar="PATH")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--selection", choices=["cluster", "random", "usage"], default="cluster",
                   help="random: the baseline (K experts drawn per layer with --seed) instead of clustering; "
                        "usage: the K most-used experts per layer (needs --usage-file)")
    p.add_argument("--usage-file", default=None, metavar="FILE",
                   help='JSON {"<global layer>": [tokens routed to each global expert]}, for --selection usage '
                        "and --representative usage")
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR (after verification)")
    return p


def main(argv: Optional[list] = None, prog: str = "convert_to_proxy.py") -> int:
    """Parse `argv`, convert; 0 on success, one `prog: error: ...` line on stderr and 2 on bad input."""
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
    args = build_parser(prog).parse_args(argv)
    from mindspeed_proxy.proxy.convert import convert
    from mindspeed_proxy.proxy.plan import Options

    options = Options(target_ep=args.target_expert_parallel_size, target_k=args.target_num_experts,
                      features=args.features, cluster=args.cluster, representative=args.representative,
                      seed=args.seed, selection=args.selection,
                      usage_file=args.usage_file)
    try:
        convert(args.load, args.save, options, iteration=args.iteration, dry_run=args.dry_run,
                overwrite=args.overwrite)
    except ConversionError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0
