"""`convert_to_proxy.py` / `mindspeed-proxy convert`: command-line front end of the converter."""
from __future__ import annotations

import argparse
import os
import warnings
from typing import Optional

from mindspeed_proxy.extras import MissingExtra
from mindspeed_proxy.proxy.core.errors import ConversionError


def build_parser(prog: str = "convert_to_proxy.py") -> argparse.ArgumentParser:
    """The converter's flags."""
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False, description=(
        "Build a proxy of a Megatron or Hugging Face MoE checkpoint: keep one representative expert per "
        "cluster, at a smaller expert-parallel size."))
    p.add_argument("--load", required=True, metavar="CKPT_DIR")
    p.add_argument("--format", choices=["auto", "megatron", "hf"], default="auto",
                   help="auto (default): a folder with config.json and model.safetensors[.index.json] is read as a "
                        "Hugging Face checkpoint (Qwen2/3-MoE, Mixtral, DeepSeek-V2/V3), anything else as Megatron")
    p.add_argument("--save", metavar="OUT_DIR", help="required unless --dry-run")
    p.add_argument("--target-expert-parallel-size", type=int, required=True, metavar="EP2",
                   help="the proxy's expert-parallel size (Hugging Face: the EP it is meant to run at; K is "
                        "checked against it, nothing else depends on it)")
    p.add_argument("--target-num-experts", type=int, required=True, metavar="K")
    p.add_argument("--iteration", type=int, default=None, help="default: the tracker's iteration")
    p.add_argument("--features", default=None, metavar="weights|outputs|FILE",
                   help="weights: data-free (flattened expert weights + router row, default); outputs: mean "
                        "expert output on --calibration-data tokens (the original model is run on CPU); FILE: "
                        'per-layer features collected during training, .npz or .pt mapping "<global layer>" -> '
                        "[E, D] array (docs/proxy.md)")
    p.add_argument("--cluster", choices=["agglomerative", "kmeans"], default=None,
                   help="default: agglomerative (average linkage, angular distance); kmeans with --usage-weighted")
    p.add_argument("--usage-weighted", action="store_true",
                   help="usage-weighted clustering: k-means whose sample weights are the experts' usage shares "
                        "(from --usage-file or the calibration tokens), so rarely used experts do not claim "
                        "clusters of their own")
    p.add_argument("--representative", choices=["medoid", "usage", "saliency", "merge"], default=None,
                   help="the expert kept per cluster: medoid (default); usage: most-used member; saliency: "
                        "highest REAP-like saliency (mean over calibration tokens routed to it of gate value x "
                        "expert output norm; needs --calibration-data); merge: the cluster's usage-weighted "
                        "average expert with the usage-weighted average router row (NOT bit-exact; legacy "
                        "checkpoints only; recorded as such in the manifest)")
    p.add_argument("--calibration-data", default=None, metavar="PATH",
                   help="tokens for --features outputs: a Megatron indexed dataset prefix (PATH.bin/.idx), or a "
                        ".npy / .pt integer array [N, S] of token ids; the router's counts on them also serve "
                        "--representative usage and --selection usage when no --usage-file is given")
    p.add_argument("--calibration-sequences", type=int, default=64, metavar="N",
                   help="use the first N calibration sequences (default 64)")
    p.add_argument("--save-features", default=None, metavar="FILE.npz",
                   help="also write the outputs / FILE features used to FILE.npz (reusable as --features FILE; "
                        "written even with --dry-run)")
    p.add_argument("--keep-optimizer-args", action="store_true",
                   help="keep opt_param_scheduler and print launch flags without --finetune, so the proxy "
                        "resumes at the source's iteration and consumed samples (optimizer moments and RNG "
                        "are always dropped); default: a fresh start with --finetune")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--selection", choices=["cluster", "random", "usage", "reconstruction"], default=None,
                   help="default: reconstruction when --calibration-data is given and no clustering option "
                        "(--features, --cluster, --representative, --usage-weighted) is, else cluster "
                        "(docs/results/proxy_fidelity.md); random: the baseline (K experts drawn per layer with "
                        "--seed) instead of clustering; "
                        "usage: the K most-used experts per layer (needs --usage-file, or --features outputs with "
                        "--calibration-data); reconstruction: per layer the K experts whose proxy layer output "
                        "(with the proxy's own re-routing) is closest to the original layer's on the calibration "
                        "tokens (needs --calibration-data)")
    p.add_argument("--reconstruction-inputs", choices=["proxy", "original"], default="proxy",
                   help="--selection reconstruction scores each layer on the inputs of the model pruned so far "
                        "(proxy, default) or of the original model (original: layer-local)")
    p.add_argument("--usage-file", default=None, metavar="FILE",
                   help='JSON {"<global layer>": [tokens routed to each global expert]}, for --selection usage '
                        "and --representative usage (takes precedence over calibration counts)")
    p.add_argument("--non-finite-experts", choices=["refuse", "keep", "exclude"], default="refuse",
                   help="experts whose weights or router row hold NaN/Inf: refuse (default: one line naming the "
                        "tensor, layer and expert ids, nothing written); keep: still selectable, copied as they "
                        "are if kept; exclude: never selected. Recorded in the manifest (docs/proxy.md)")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="load the source's .pt files with full unpickling (weights_only=False), for args holding "
                        "types outside megatron-core's safe globals (other forks). A malicious checkpoint can then "
                        "run arbitrary code: use only for files you trust (never the default)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="legacy: proxy files written by N forked processes; torch_dist: N writer threads (N .distcp "
                        "files); default: the cores this process may use. The legacy output is bit-identical for "
                        "any N")
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR (after verification)")
    return p


def _check_save_features(args, options) -> None:
    path = args.save_features
    if path is None:
        return
    if options.feature_type == "weights":
        raise ConversionError("--save-features needs --features outputs or FILE (weight features are not vectors)")
    if not path.endswith(".npz"):
        raise ConversionError(f"--save-features {path}: the name must end in .npz")
    if os.path.exists(path) and not args.overwrite:
        raise ConversionError(f"--save-features {path} already exists (pass --overwrite to replace it)")
    from mindspeed_proxy.proxy.convert import _inside

    if _inside(path, args.load):
        raise ConversionError(f"--save-features {path} is inside --load {args.load}: the source is never written")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ConversionError(f"--save-features {path}: parent folder does not exist")


def default_selection(args) -> str:
    """--selection as given, else the rule of Options (options.default_selection) on the parsed flags."""
    if args.selection is not None:
        return args.selection
    return options_from_args(args).selection


def options_from_args(args):
    """The Options the parsed flags describe: the flags as given, every default resolved by Options itself."""
    from mindspeed_proxy.proxy.core.options import Options

    return Options(target_ep=args.target_expert_parallel_size, target_k=args.target_num_experts,
                   features=args.features, representative=args.representative, cluster=args.cluster,
                   usage_weighted=args.usage_weighted, reconstruction_inputs=args.reconstruction_inputs,
                   seed=args.seed, selection=args.selection, usage_file=args.usage_file,
                   calibration_data=args.calibration_data, calibration_sequences=args.calibration_sequences,
                   keep_optimizer_args=args.keep_optimizer_args, trust_checkpoint=args.trust_checkpoint,
                   non_finite_experts=args.non_finite_experts)


def main(argv: Optional[list] = None, prog: str = "convert_to_proxy.py") -> int:
    """Parse `argv`, convert; 0 on success, one `prog: error: ...` line on stderr and 2 on bad input."""
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
    args = build_parser(prog).parse_args(argv)
    from mindspeed_proxy.patches import eager_jit

    # megatron-core imported during the command (torch_dist IO, the calibration forward on CPU) keeps eager fused
    # functions; torch.compile is given back when the command returns
    with eager_jit.apply():
        return _convert(args, prog)


def _convert(args: argparse.Namespace, prog: str) -> int:
    from mindspeed_proxy.cli import error
    from mindspeed_proxy.proxy.io import pages
    from mindspeed_proxy.proxy.convert import convert, default_workers

    if args.workers is not None and args.workers < 1:
        return error(prog, f"--workers {args.workers}: must be at least 1")

    pages.pin_mmap_threshold()  # process-wide, so the command sets it, not convert(): staging buffers leave RSS
    try:
        options = options_from_args(args)
        _check_save_features(args, options)
        plan = convert(args.load, args.save, options, iteration=args.iteration, dry_run=args.dry_run,
                       overwrite=args.overwrite, fmt=args.format,
                       workers=args.workers if args.workers is not None else default_workers())
        if args.save_features:
            from mindspeed_proxy.proxy.io.features_file import write_features_file

            write_features_file(args.save_features, plan.vectors)
            print(f"features written to {args.save_features}")
    except (ConversionError, MissingExtra) as exc:
        return error(prog, exc)
    return 0
