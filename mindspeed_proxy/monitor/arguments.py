"""The mechanism-monitor command-line flags (Megatron-LM spelling) and the MonitorConfig they describe."""
from __future__ import annotations

import argparse
import os

from mindspeed_proxy.monitor.config import MonitorConfig


def add_monitor_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add --enable-mechanism-monitor and its companions to `parser` (a parser that has them is kept); return it."""
    if "--enable-mechanism-monitor" in parser._option_string_actions:
        return parser
    group = parser.add_argument_group("mechanism monitor (mindspeed-proxy)")
    group.add_argument("--enable-mechanism-monitor", action="store_true",
                       help="sample ΔW / Δ2 spectra and router health and raise mechanism alerts")
    group.add_argument("--mechanism-monitor-config", default=None, help="MonitorConfig as JSON or YAML")
    group.add_argument("--mechanism-monitor-interval", type=int, default=None, help="spectral sample interval")
    group.add_argument("--mechanism-monitor-delta", type=int, default=None, help="δ of ΔW = W_t - W_{t-δ}")
    group.add_argument("--mechanism-monitor-output", default=None, help="directory of monitor.jsonl")
    group.add_argument("--mechanism-monitor-collect-expert-features", action="store_true", default=None,
                       help="write expert_features.npz and expert_usage.json (per MoE layer: mean output of every "
                            "expert on every token, tokens routed per expert) for convert_to_proxy.py --features "
                            "FILE --usage-file FILE (docs/monitor.md)")
    group.add_argument("--mechanism-monitor-expert-features-start", type=int, default=None, metavar="STEP",
                       help="first sampled optimizer step of the expert-feature window (default 1)")
    group.add_argument("--mechanism-monitor-expert-features-interval", type=int, default=None, metavar="N",
                       help="sample every N-th step in the window (default 1)")
    group.add_argument("--mechanism-monitor-expert-features-steps", type=int, default=None, metavar="N",
                       help="number of sampled steps in the window (default 1)")
    group.add_argument("--mechanism-routing-replay", choices=["off", "r3"], default="off",
                       help="r3: Megatron-LM train_rl.py replays the experts its inference engine chose at rollout "
                            "in every training-side pass (megatron-core RouterReplay; docs/megatron_lm.md)")
    group.add_argument("--mechanism-offset-sampling-seed-by-dp-rank", action="store_true", default=False,
                       help="Megatron-LM train_rl.py on megatron-core 0.16-0.18: seed each data-parallel engine's "
                            "sampler with --seed + its data-parallel rank, as core_v0.19 does by default (else two "
                            "engines draw the same samples for the same prompt; docs/megatron_lm.md)")
    group.add_argument("--mechanism-monitor-rl-gap-interval", type=int, default=0, metavar="N",
                       help="Megatron-LM train_rl.py: every N-th rollout collection also split the train-rollout "
                            "logprob gap into expert flips, routing weights and the rest (3 extra no-grad forwards "
                            "of --mechanism-monitor-rl-gap-samples rows per rank); 0 = off")
    group.add_argument("--mechanism-monitor-rl-gap-samples", type=int, default=8, metavar="N",
                       help="rows per rank the gap decomposition runs on")
    group.add_argument("--inject-fault", action="append", default=[], metavar="NAME[:key=value,...]",
                       help="fault injector, repeatable: lowp-attention, lr-spike, small-gbs, router-bf16, "
                            "grad-overflow (see docs/faults.md)")
    return parser


def monitor_config_from_args(args: argparse.Namespace, default_output: str = "mechanism_monitor") -> MonitorConfig:
    """MonitorConfig from --mechanism-monitor-config overlaid with the explicit flags."""
    path = getattr(args, "mechanism_monitor_config", None)
    data = MonitorConfig.read_file(path) if path else {}
    if getattr(args, "mechanism_monitor_interval", None) is not None:
        data["interval"] = args.mechanism_monitor_interval
    if getattr(args, "mechanism_monitor_delta", None) is not None:
        data["delta"] = args.mechanism_monitor_delta
    for key in ("collect_expert_features", "expert_features_start", "expert_features_interval",
                "expert_features_steps"):
        value = getattr(args, f"mechanism_monitor_{key}", None)
        if value is not None:
            data[key.replace("collect_", "")] = value
    data["output_dir"] = getattr(args, "mechanism_monitor_output", None) or data.get("output_dir") or default_output
    return MonitorConfig.from_dict(data)


def monitor_flags_in(argv: list[str]) -> argparse.Namespace:
    """Our flags parsed out of any command line (other flags ignored)."""
    parser = add_monitor_arguments(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    args, _ = parser.parse_known_args(argv)
    return args


def monitor_flags_from(args) -> argparse.Namespace:
    """Our flags, typed, out of a namespace another parser filled (a pre-parse that did not know them keeps
    `--mechanism-monitor-interval 4` as the string "4"; absent flags take their defaults)."""
    parser = add_monitor_arguments(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    flags = parser.parse_args([])
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if value is None or action.dest == "help":
            continue
        if isinstance(value, str) and action.type is not None:
            try:
                value = action.type(value)
            except ValueError:
                raise ValueError(f"{action.option_strings[0]} {value!r}: expected {action.type.__name__}") from None
        setattr(flags, action.dest, value)
    return flags


def default_output_dir(base: str) -> str:
    """`base/mechanism_monitor`."""
    return os.path.join(base, "mechanism_monitor")
