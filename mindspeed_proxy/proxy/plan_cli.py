"""`mindspeed-proxy plan`: the proxy options of a real model on a given cluster (planner.py)."""
from __future__ import annotations

import argparse
import json
import shlex
from typing import Optional

from mindspeed_proxy.cli import error
from mindspeed_proxy.proxy import model_spec, planner
from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.core.layout import check_k

PROG = "mindspeed-proxy plan"
# Megatron-LM model flags the planner reads (same names and meanings as megatron/training/arguments.py)
INT_FLAGS = ("num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads", "num-query-groups",
             "kv-channels", "num-experts", "moe-ffn-hidden-size", "moe-router-topk",
             "moe-shared-expert-intermediate-size", "moe-router-num-groups", "moe-router-group-topk",
             "q-lora-rank", "kv-lora-rank", "qk-head-dim", "qk-pos-emb-head-dim", "v-head-dim", "vocab-size",
             "make-vocab-size-divisible-by", "mtp-num-layers")
BOOL_FLAGS = ("group-query-attention", "swiglu", "untie-embeddings-and-output-weights", "multi-latent-attention",
              "qk-layernorm", "moe-router-enable-expert-bias", "moe-shared-expert-gate", "add-qkv-bias",
              "moe-tp-extend-ep")


def build_parser() -> argparse.ArgumentParser:
    """The planner's flags: one model source, the cluster, the run, the cost-model rates."""
    p = argparse.ArgumentParser(prog=PROG, allow_abbrev=False, description=(
        "List the proxies the converter's EP rules allow for a model on a cluster, with parameters, memory per "
        "rank, FLOPs per token, accelerators and the estimated per-step cost ratio (docs/proxy.md)."))
    g = p.add_argument_group("model (one source)")
    g.add_argument("--load", metavar="CKPT_DIR", help="a Megatron checkpoint (legacy or torch_dist): its args; a "
                   "Hugging Face folder (config.json + safetensors): its config.json")
    g.add_argument("--iteration", type=int, default=None)
    g.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its folder)")
    g.add_argument("--megatron-args-file", metavar="FILE",
                   help="Megatron-LM flags as in a launch script (other flags in it are ignored); flags given on "
                        "this command line override it")
    m = p.add_argument_group("Megatron-LM model flags (instead of --load / --hf-config)")
    for name in INT_FLAGS:
        m.add_argument(f"--{name}", type=int, default=None)
    for name in BOOL_FLAGS:
        m.add_argument(f"--{name}", action="store_true", default=None)
    m.add_argument("--moe-layer-freq", default=None, help="N or a list expression, e.g. '([0]*3+[1]*58)'")
    m.add_argument("--disable-bias-linear", action="store_true", default=None)
    m.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default=None)
    c = p.add_argument_group("cluster and run (default: what a checkpoint recorded)")
    c.add_argument("--tensor-model-parallel-size", type=int, default=None)
    c.add_argument("--pipeline-model-parallel-size", type=int, default=None)
    c.add_argument("--expert-model-parallel-size", type=int, default=None)
    c.add_argument("--data-parallel-size", type=int, default=None, help="default: world size / (TP x PP), else EP")
    c.add_argument("--world-size", type=int, default=None)
    c.add_argument("--accelerator-memory-gib", type=float, required=True, metavar="GIB")
    c.add_argument("--seq-length", type=int, default=None)
    c.add_argument("--micro-batch-size", type=int, default=None)
    c.add_argument("--global-batch-size", type=int, default=None, help="default: micro-batch x DP (Megatron's)")
    c.add_argument("--use-distributed-optimizer", action="store_true", default=None)
    c.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="full: each layer keeps only its input (one recompute per layer); selective: no change "
                        "with flash attention")
    t = p.add_argument_group("proxy options (default: per EP2 dividing EP, K = E x EP2 / EP)")
    t.add_argument("--target-expert-parallel-size", type=int, nargs="+", default=None, metavar="EP2")
    t.add_argument("--target-num-experts", type=int, nargs="+", default=None, metavar="K")
    h = p.add_argument_group("step-cost model rates")
    d = planner.Hardware()
    h.add_argument("--peak-tflops", type=float, default=d.peak_tflops, help="dense bf16 peak per accelerator")
    h.add_argument("--mfu", type=float, default=d.mfu, help="share of the peak the matmuls sustain")
    h.add_argument("--hbm-gbs", type=float, default=d.hbm_gbs, help="memory bandwidth, GB/s")
    h.add_argument("--intra-node-gbs", type=float, default=d.intra_gbs, help="per-device bandwidth inside a node")
    h.add_argument("--inter-node-gbs", type=float, default=d.inter_gbs, help="per-device bandwidth across nodes")
    h.add_argument("--devices-per-node", type=int, default=d.devices_per_node)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _flag_values(ns: argparse.Namespace) -> dict:
    names = [f.replace("-", "_") for f in INT_FLAGS + BOOL_FLAGS] + ["moe_layer_freq", "disable_bias_linear",
                                                                     "normalization"]
    return {n: getattr(ns, n) for n in names if getattr(ns, n) is not None}


def _read_flags_file(path: str) -> dict:
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as exc:
        raise ConversionError(f"--megatron-args-file {path}: cannot read ({exc.strerror})") from None
    try:
        words = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as exc:
        raise ConversionError(f"--megatron-args-file {path}: {exc}") from None
    ns, _ = build_parser().parse_known_args(words + ["--accelerator-memory-gib", "1"])
    return {**_flag_values(ns), **{k: getattr(ns, k) for k in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
        "data_parallel_size", "world_size", "seq_length", "micro_batch_size", "global_batch_size",
        "use_distributed_optimizer", "recompute_granularity") if getattr(ns, k) is not None}}


def model_and_defaults(args) -> tuple:
    """(ModelSpec, {run field: value} recorded with the model) from exactly one model source."""
    flags = _flag_values(args)
    sources = [n for n, v in (("--load", args.load), ("--hf-config", args.hf_config),
                              ("--megatron-args-file", args.megatron_args_file)) if v]
    if len(sources) > 1 or (flags and sources and sources != ["--megatron-args-file"]):
        given = sources + (["model flags"] if flags else [])
        raise ConversionError(f"give one model source, not {' and '.join(given)}")
    if args.hf_config:
        return model_spec.read_hf_config(args.hf_config), {}
    if args.load and _is_hf_folder(args.load):  # as the converter: a config.json + safetensors folder is HF
        return model_spec.read_hf_config(args.load), {}
    if args.load:
        ns, where = model_spec.read_checkpoint_args(args.load, args.iteration), f"--load {args.load}"
    elif args.megatron_args_file or flags:
        values = {**(_read_flags_file(args.megatron_args_file) if args.megatron_args_file else {}), **flags}
        if args.tensor_model_parallel_size:  # pads the vocabulary like Megatron does
            values["tensor_model_parallel_size"] = args.tensor_model_parallel_size
        if values.pop("disable_bias_linear", None):
            values["add_bias_linear"] = False
        ns = argparse.Namespace(**values)
        where = f"--megatron-args-file {args.megatron_args_file}" if args.megatron_args_file else "the model flags"
    else:
        raise ConversionError("no model: give --load CKPT_DIR, --hf-config PATH, --megatron-args-file FILE or the "
                              "Megatron model flags (--num-layers, --hidden-size, --num-experts, ...)")
    spec = model_spec.from_megatron_args(ns, where)
    recorded = {k: getattr(ns, k, None) for k in ("use_distributed_optimizer", "recompute_granularity",
                                                  "tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                  "expert_model_parallel_size", "data_parallel_size", "world_size")}
    return spec, {k: v for k, v in recorded.items() if v is not None}


def _is_hf_folder(path: str) -> bool:
    from mindspeed_proxy.proxy.io.hf.checkpoint import looks_like_hf

    return looks_like_hf(path)


def _pick(*values):
    return next((v for v in values if v is not None), None)


def layout_and_run(args, spec, recorded) -> tuple:
    """The original's Layout and the Run from the flags, falling back on what the model source recorded."""
    tp = _pick(args.tensor_model_parallel_size, recorded.get("tensor_model_parallel_size"), 1)
    pp = _pick(args.pipeline_model_parallel_size, recorded.get("pipeline_model_parallel_size"), 1)
    ep = _pick(args.expert_model_parallel_size, recorded.get("expert_model_parallel_size"))
    if ep is None:
        raise ConversionError("--expert-model-parallel-size is required (the model source records none)")
    world = _pick(args.world_size, None if args.data_parallel_size else recorded.get("world_size"))
    dp = _pick(args.data_parallel_size, world // (tp * pp) if world else None,
               recorded.get("data_parallel_size"), ep)
    if world and world != tp * pp * dp:
        raise ConversionError(f"--world-size {world} is not TP {tp} x PP {pp} x DP {dp}")
    layout = planner.source_layout(spec, tp, pp, ep, dp)
    seq = _pick(args.seq_length, spec.seq_length)
    mbs = _pick(args.micro_batch_size, spec.micro_batch, 1)
    if not seq:
        raise ConversionError("--seq-length is required (the model source records none)")
    hw = planner.Hardware(args.peak_tflops, args.mfu, args.hbm_gbs, args.intra_node_gbs, args.inter_node_gbs,
                          args.devices_per_node)
    if min(hw.peak_tflops, hw.mfu, hw.hbm_gbs, hw.intra_gbs, hw.inter_gbs, hw.devices_per_node) <= 0:
        raise ConversionError("the step-cost rates (--peak-tflops, --mfu, --*-gbs, --devices-per-node) must be > 0")
    run = planner.Run(seq_length=int(seq), micro_batch=int(mbs),
                      global_batch=int(_pick(args.global_batch_size, spec.global_batch, mbs * dp)),
                      memory_gib=args.accelerator_memory_gib,
                      distributed_optimizer=bool(_pick(args.use_distributed_optimizer,
                                                       recorded.get("use_distributed_optimizer"), False)),
                      recompute=_pick(args.recompute_granularity, recorded.get("recompute_granularity")) == "full",
                      hardware=hw)
    return layout, run


def main(argv: Optional[list] = None) -> int:
    """Parse `argv`, print the plan; 0, or one `mindspeed-proxy plan: error: ...` line and 2 on bad input."""
    args = build_parser().parse_args(argv)
    try:
        spec, recorded = model_and_defaults(args)
        layout, run = layout_and_run(args, spec, recorded)
        explicit = args.target_num_experts and args.target_expert_parallel_size
        result = planner.plan(spec, layout, run, args.target_expert_parallel_size, args.target_num_experts)
        refused = [r for r in result["proxies"] if "refused" in r]
        if explicit and len(refused) == len(result["proxies"]):  # the converter's own message
            try:
                check_k(refused[0]["K"], **planner.rules(spec, layout, refused[0]["ep"]))
            except ConversionError as exc:
                raise ConversionError(f"at --target-expert-parallel-size {refused[0]['ep']}: {exc}") from None
    except ConversionError as exc:
        return error(PROG, exc)
    print(json.dumps(result, indent=1) if args.json else planner.describe(result, spec, run))
    return 0
