"""`--mechanism-routing-replay r3` on Megatron-LM's args: switch megatron-core's RouterReplay on, or refuse in one line.

`--mechanism-monitor-rl-gap-interval N` needs RouterReplay as well (its passes replay the rollout's experts):
it also sets `moe_enable_routing_replay` (an idle RouterReplay routes as without it).

R3 replays the experts megatron-core's dynamic engine chose at rollout in every training-side pass of
train_rl.py (patches/rl_rows.py). It needs `RouterReplay` (megatron-core 0.16+), sets the TransformerConfig
field `moe_enable_routing_replay` (core_transformer_config_from_args copies every args attribute named like a
config field) and refuses what it does not read: sequence packing, activation recompute (the backward would
re-route without REPLAY_BACKWARD), tensor parallelism (the router sees sequence-parallel shards), a separate
inference model (its routers would join RouterReplay's global list).
"""
from __future__ import annotations

from mindspeed_proxy.cli import fail

PROG = "mindspeed-proxy --mechanism-routing-replay"
REFUSED = {
    "rl_use_sequence_packing": "--rl-use-sequence-packing (R3 matches unpacked rows to the rollouts)",
    "recompute_granularity": "--recompute-granularity (a recomputed forward would route again)",
    "rl_inference_tensor_model_parallel_size": "--rl-inference-tensor-model-parallel-size (a separate "
                                               "inference model)",
    "rl_inference_expert_model_parallel_size": "--rl-inference-expert-model-parallel-size (a separate "
                                               "inference model)",
    "rl_inference_pipeline_model_parallel_size": "--rl-inference-pipeline-model-parallel-size (a separate "
                                                 "inference model)",
}


def check_available() -> None:
    """Exit 2 with one line when the imported megatron-core has no RouterReplay."""
    from mindspeed_proxy.rl.replay import router_replay_class

    if router_replay_class() is None:
        import megatron.core as core

        version = getattr(getattr(core, "package_info", None), "__version__", "unknown")
        fail(PROG, f"r3 needs megatron-core's RouterReplay (megatron/core/transformer/moe/router_replay.py, "
                   f"0.16+); megatron-core {version} has none")


def apply_routing_replay(args) -> None:
    """With r3 on Megatron-LM's parsed `args`: refuse what R3 does not support, else set moe_enable_routing_replay."""
    from mindspeed_proxy.patches.runtime import RUNTIME

    mode = getattr(args, "mechanism_routing_replay", None) or "off"
    RUNTIME.routing_replay = mode
    gap = getattr(args, "mechanism_monitor_rl_gap_interval", 0) or 0
    if gap < 0 or (getattr(args, "mechanism_monitor_rl_gap_samples", 8) or 0) < 1:
        fail("mindspeed-proxy --mechanism-monitor-rl-gap-interval", "the interval must be >= 0 and "
             "--mechanism-monitor-rl-gap-samples >= 1")
    RUNTIME.rl_gap_interval, RUNTIME.rl_gap_samples = gap, getattr(args, "mechanism_monitor_rl_gap_samples", 8)
    if gap:
        check_available()
        args.moe_enable_routing_replay = True
    if mode != "r3":
        return
    check_available()
    for name, flag in REFUSED.items():
        if getattr(args, name, None) not in (None, False):
            fail(PROG, f"r3 does not support {flag}")
    if (getattr(args, "tensor_model_parallel_size", 1) or 1) > 1:
        fail(PROG, f"r3 does not support --tensor-model-parallel-size {args.tensor_model_parallel_size} (the "
                   "router sees sequence-parallel shards of the tokens); use TP=1")
    args.moe_enable_routing_replay = True
