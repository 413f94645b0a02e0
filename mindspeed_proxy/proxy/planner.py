"""`mindspeed-proxy plan`: parameters, memory per rank, FLOPs and per-step cost of a model's proxies (docs/proxy.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.core.layout import Layout, k_violations, target_layout, valid_k_values
from mindspeed_proxy.proxy.core.plan_types import rules_from_args
from mindspeed_proxy.proxy.model_spec import ModelSpec

GIB = 2 ** 30
OPT_STEP_BYTES = 30   # per owned parameter: read fp32 grad 4, read+write fp32 main, Adam m, v (3 x 8), write bf16 2
USABLE = 0.9          # share of accelerator memory the estimate may use (workspace, fragmentation, buffers)


@dataclass(frozen=True)
class Hardware:
    """Rates of the step-cost model (defaults: an H100/H200-class accelerator, 8 per node, 400 Gb/s per GPU)."""

    peak_tflops: float = 989.0
    mfu: float = 0.4
    hbm_gbs: float = 3350.0
    intra_gbs: float = 450.0
    inter_gbs: float = 50.0
    devices_per_node: int = 8


@dataclass(frozen=True)
class Run:
    """Training settings shared by the original and its proxies."""

    seq_length: int
    micro_batch: int
    global_batch: int
    memory_gib: float
    distributed_optimizer: bool = False
    recompute: bool = False  # --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    hardware: Hardware = Hardware()


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def norm_params(s: ModelSpec, width: int) -> int:
    """One norm over `width` features: weight (RMSNorm) or weight + bias (LayerNorm)."""
    return width * (2 if s.layernorm else 1)


def attention_params(s: ModelSpec) -> int:
    """Self-attention weights of one layer (MLA or GQA), its input norm excluded."""
    h, n = s.hidden, s.heads
    if s.mla:
        m = s.mla
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        latent = (lambda width: norm_params(s, width)) if s.qk_norm else (lambda width: 0)  # latent norms
        q = (h * m.q_lora_rank + latent(m.q_lora_rank) + m.q_lora_rank * n * qk) if m.q_lora_rank \
            else h * n * qk
        kv = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + latent(m.kv_lora_rank) + \
            m.kv_lora_rank * n * (m.qk_head_dim + m.v_head_dim)
        return q + kv + _linear(n * m.v_head_dim, h, s.bias_linear)
    q, kv = n * s.head_dim, s.kv_heads * s.head_dim
    norms = 2 * norm_params(s, s.head_dim) if s.qk_norm else 0
    return _linear(h, q + 2 * kv, s.qkv_bias) + _linear(q, h, s.bias_linear) + norms


def mlp_params(s: ModelSpec, ffn: int) -> int:
    """One MLP (a dense layer's, one expert's or the shared expert's) of intermediate size `ffn`."""
    return _linear(s.hidden, ffn * (2 if s.gated else 1), s.bias_linear) + _linear(ffn, s.hidden, s.bias_linear)


def router_params(s: ModelSpec, k: int) -> int:
    """Router rows of `k` experts (+ expert bias) and Qwen2-MoE's shared-expert gate."""
    return k * s.hidden + (k if s.router_bias else 0) + (s.hidden if s.shared_gate else 0)


def layer_params(s: ModelSpec, i: int, k: int) -> tuple:
    """(non-expert, routed-expert, active) parameters of decoder layer `i` with `k` experts per MoE layer."""
    base = attention_params(s) + 2 * norm_params(s, s.hidden)
    if not s.moe_layers[i]:
        dense = base + mlp_params(s, s.ffn)
        return dense, 0, dense
    shared = mlp_params(s, s.shared_ffn) if s.shared_ffn else 0
    dense = base + router_params(s, k) + shared
    return dense, k * mlp_params(s, s.moe_ffn), dense + s.topk * mlp_params(s, s.moe_ffn)


def embedding_params(s: ModelSpec) -> tuple:
    """(input embedding, output layer + final norm): the output layer is 0 when tied."""
    table = s.vocab * s.hidden
    return table, (0 if s.tied else table) + norm_params(s, s.hidden)


def count(s: ModelSpec, k: Optional[int] = None) -> dict:
    """Total and active (per token) parameters with `k` experts per MoE layer (default: the model's own E)."""
    k = s.num_experts if k is None else k
    layers = [layer_params(s, i, k) for i in range(s.num_layers)]
    emb, out = embedding_params(s)
    return {"total": sum(d + e for d, e, _ in layers) + emb + out, "active": sum(a for *_, a in layers) + emb + out,
            "experts": sum(e for _, e, _ in layers), "embedding": emb + out}


def mtp_count(s: ModelSpec, k: Optional[int] = None) -> dict:
    """Parameters of the multi-token prediction module with `k` experts per MoE layer, as Megatron stores it
    (megatron-core's MultiTokenPredictionLayer: enorm, hnorm, eh_proj [h, 2h], one transformer layer built
    from the decoder's last layer spec, final norm; embedding and output layer shared with the model).
    Kept out of `count`, as the published totals keep it out (DeepSeek-V3: 671B without its MTP module)."""
    k = s.num_experts if k is None else k
    if not s.mtp_layers:
        return {"total": 0, "experts": 0}
    dense, experts, _ = layer_params(s, s.num_layers - 1, k)
    per = dense + experts + 3 * norm_params(s, s.hidden) + 2 * s.hidden * s.hidden
    return {"total": s.mtp_layers * per, "experts": s.mtp_layers * experts}


def flops_per_token(s: ModelSpec, k: int, seq: int, recompute: bool = False) -> float:
    """Training FLOPs per token: 6 x matmul parameters a token meets (+2 x with full recompute) plus causal
    attention scores 3 x heads x (d_qk + d_v) x seq per layer (x4/3 with recompute); embedding lookup is free."""
    c = count(s, k)
    matmul = c["active"] - s.vocab * s.hidden - s.num_layers * 2 * norm_params(s, s.hidden) - \
        (s.num_moe_layers * k if s.router_bias else 0)
    d_qk, d_v = (s.mla.qk_head_dim + s.mla.qk_pos_emb_head_dim, s.mla.v_head_dim) if s.mla else (s.head_dim,) * 2
    attention = s.num_layers * s.heads * (d_qk + d_v) * seq  # forward, causal: seq/2 keys x 2 matmuls x 2 FLOPs
    passes = 4 if recompute else 3
    return 2 * passes * matmul + passes * attention


def layer_activation_values(s: ModelSpec, i: int, k: int) -> int:
    """Values layer `i` keeps per token for its backward (bf16; flash attention keeps no score matrix)."""
    h = s.hidden
    if s.mla:
        m = s.mla
        qk = s.heads * (m.qk_head_dim + m.qk_pos_emb_head_dim)
        attn = 2 * h + 2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank + m.qk_pos_emb_head_dim + 2 * qk + \
            2 * s.heads * m.v_head_dim
    else:
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        attn = 2 * h + 2 * q + 2 * kv
    mult = 3 if s.gated else 2
    if not s.moe_layers[i]:
        return attn + 2 * h + mult * s.ffn
    # router logits and probabilities in fp32 (2 bf16-sized values each), k copies of the token dispatched,
    # each copy's fc1 output and activation, its expert output kept for the weighted combine
    return attn + 2 * h + 4 * k + s.topk * (2 * h + mult * s.moe_ffn) + mult * s.shared_ffn


def stages(num_layers: int, pp: int) -> list:
    """Contiguous layer ranges per pipeline stage, sizes differing by at most 1 (the first stages larger)."""
    per, extra = divmod(num_layers, pp)
    out, start = [], 0
    for p in range(pp):
        end = start + per + (1 if p < extra else 0)
        out.append(range(start, end))
        start = end
    return out


def _edp(layout: Layout) -> int:
    """Expert-data-parallel size: TP x DP / (EP x expert TP); expert TP = TP, or 1 with moe_tp_extend_ep."""
    return layout.tp * layout.dp // (layout.ep * (1 if layout.tp_extend_ep else layout.tp))


def stage_memory(s: ModelSpec, layout: Layout, run: Run, p: int) -> dict:
    """Bytes per rank of pipeline stage `p`: bf16 weights, fp32 main grads, fp32 main params + Adam moments
    (sharded over DP / expert DP with the distributed optimizer), activations of the micro-batches in flight."""
    k, tp = layout.num_experts, layout.tp
    rng = stages(s.num_layers, layout.pp)[p]
    emb, out = embedding_params(s)
    dense = sum(layer_params(s, i, k)[0] for i in rng)
    dense += (emb if p == 0 else 0) + (out + (emb if s.tied and layout.pp > 1 else 0) if p == layout.pp - 1 else 0)
    local = k // layout.expert_shards
    expert = sum(local * mlp_params(s, s.moe_ffn) for i in rng if s.moe_layers[i]) // \
        (1 if layout.tp_extend_ep else tp)
    dense //= tp
    owned = dense / layout.dp + expert / _edp(layout) if run.distributed_optimizer else dense + expert
    tokens = run.seq_length * run.micro_batch / tp  # sequence parallel splits every stored activation over TP
    micro = run.global_batch // (run.micro_batch * layout.dp)
    in_flight = min(layout.pp - p, micro)
    per_layer = [2 * layer_activation_values(s, i, k) * tokens for i in rng]
    if run.recompute:  # only each layer's input is kept; one layer's full set while it is recomputed
        act = in_flight * len(rng) * 2 * s.hidden * tokens + max(per_layer, default=0)
    else:
        act = in_flight * sum(per_layer)
    if p == layout.pp - 1:
        act += 6 * tokens * s.vocab  # bf16 logits + fp32 softmax of one micro-batch (vocab split over TP)
    parts = {"weights": 2 * (dense + expert), "grads": 4 * (dense + expert), "optimizer": 12 * owned,
             "activations": act}
    parts["total"] = sum(parts.values())
    parts["stage"] = p
    return parts


def memory(s: ModelSpec, layout: Layout, run: Run) -> dict:
    """The stage_memory of the pipeline stage that needs the most."""
    return max((stage_memory(s, layout, run, p) for p in range(layout.pp)), key=lambda m: m["total"])


def step_seconds(s: ModelSpec, layout: Layout, run: Run) -> dict:
    """Estimated seconds of one step per term: compute with the 1F1B bubble, exposed all-to-all, gradient
    reduction, optimizer step (summed: no overlap assumed)."""
    hw, k, tp = run.hardware, layout.num_experts, layout.tp
    tokens = run.global_batch * run.seq_length
    micro = run.global_batch // (run.micro_batch * layout.dp)
    flops = tokens * flops_per_token(s, k, run.seq_length, run.recompute)
    compute = flops / (layout.world_size * hw.peak_tflops * 1e12 * hw.mfu) * (1 + (layout.pp - 1) / micro)
    moe_layers = max(sum(s.moe_layers[i] for i in rng) for rng in stages(s.num_layers, layout.pp))
    ep = layout.expert_shards
    span = layout.tp * layout.ep  # Megatron orders TP, then EP inside DP: an EP group spans TP x EP ranks
    bw = hw.intra_gbs if span <= hw.devices_per_node else hw.inter_gbs
    # per routed copy: h bf16 values dispatched and combined, forward and backward (8 h bytes), (ep-1)/ep leave
    a2a = tokens / (layout.dp * tp) * moe_layers * 8 * s.hidden * s.topk * (ep - 1) / ep / (bw * 1e9)
    mem = memory(s, layout, run)
    dense_p = (mem["weights"] / 2) - _expert_rank_params(s, layout, mem["stage"])
    expert_p = _expert_rank_params(s, layout, mem["stage"])
    edp = _edp(layout)
    grad = 0.0
    for params, group in ((dense_p, layout.dp), (expert_p, edp)):
        if group > 1:
            bw_g = hw.intra_gbs if layout.tp * layout.pp * group <= hw.devices_per_node else hw.inter_gbs
            grad += 8 * params * (group - 1) / group / (bw_g * 1e9)
    owned = dense_p / layout.dp + expert_p / edp if run.distributed_optimizer else dense_p + expert_p
    opt = OPT_STEP_BYTES * owned / (hw.hbm_gbs * 1e9)
    out = {"compute": compute, "all_to_all": a2a, "grad_reduce": grad, "optimizer": opt}
    out["total"] = sum(out.values())
    return out


def _expert_rank_params(s: ModelSpec, layout: Layout, p: int) -> float:
    rng = stages(s.num_layers, layout.pp)[p]
    local = layout.num_experts // layout.expert_shards
    return sum(local * mlp_params(s, s.moe_ffn) for i in rng if s.moe_layers[i]) / \
        (1 if layout.tp_extend_ep else layout.tp)


def source_layout(s: ModelSpec, tp: int, pp: int, ep: int, dp: int) -> Layout:
    """The original's Layout; ConversionError when Megatron would refuse it."""
    for name, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--expert-model-parallel-size", ep), ("--data-parallel-size", dp)):
        if value < 1:
            raise ConversionError(f"{name} {value} must be >= 1")
    layout = Layout(tp=tp, pp=pp, ep=ep, num_experts=s.num_experts, dp=dp, tp_extend_ep=s.tp_extend_ep)
    if s.num_experts % layout.expert_shards:
        raise ConversionError(f"{s.num_experts} experts are not divisible by EP {ep}"
                              f"{f' x TP {tp} (moe_tp_extend_ep)' if s.tp_extend_ep else ''}")
    if dp % ep:
        raise ConversionError(f"--expert-model-parallel-size {ep} must divide the data-parallel size {dp} "
                              f"(world {layout.world_size} = TP {tp} x PP {pp} x DP {dp})")
    if pp > s.num_layers:
        raise ConversionError(f"--pipeline-model-parallel-size {pp} exceeds the {s.num_layers} layers")
    return layout


def check_run(run: Run, layout: Layout) -> None:
    """ConversionError unless the global batch splits into micro-batches over DP."""
    for name, value in (("--seq-length", run.seq_length), ("--micro-batch-size", run.micro_batch),
                        ("--accelerator-memory-gib", run.memory_gib)):
        if not value or value <= 0:
            raise ConversionError(f"{name} {value} must be > 0")
    if run.global_batch % (run.micro_batch * layout.dp):
        raise ConversionError(f"--global-batch-size {run.global_batch} is not divisible by micro-batch "
                              f"{run.micro_batch} x DP {layout.dp}")


def evaluate(s: ModelSpec, layout: Layout, run: Run) -> dict:
    """Every figure of one row of the plan (the original or a proxy)."""
    c = count(s, layout.num_experts)
    mem = memory(s, layout, run)
    step = step_seconds(s, layout, run)
    return {"K": layout.num_experts, "ep": layout.ep, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
            "ranks": layout.world_size, "params": c["total"], "active": c["active"], "memory": mem,
            "mtp": mtp_count(s, layout.num_experts),
            "fits": mem["total"] <= USABLE * run.memory_gib * GIB,
            "flops_per_token": flops_per_token(s, layout.num_experts, run.seq_length), "step": step,
            "cost": layout.world_size * step["total"]}


def rules(s: ModelSpec, layout: Layout, ep2: int) -> dict:
    """The converter's K rules (layout.k_violations keywords) for this model at proxy EP `ep2`."""
    return rules_from_args(s.routing, layout, ep2)


def proxy_options(s: ModelSpec, layout: Layout, eps=None, ks=None) -> list:
    """[(EP2, K, refused reasons)]: by default per EP2 dividing EP (below it; with `ks`, EP itself too) the K
    that keeps the experts per rank (E x EP2 / EP), or, when the rules refuse it, that K refused plus the
    smallest valid K above it."""
    eps = eps or [e for e in range(layout.ep - (0 if ks else 1), 0, -1) if layout.ep % e == 0]
    out = []
    for ep2 in eps:
        if ep2 < 1:
            raise ConversionError(f"--target-expert-parallel-size {ep2} must be >= 1")
        r = rules(s, layout, ep2)
        for k in ks or [s.num_experts * ep2 // layout.ep]:
            problems = k_violations(k, **r)
            out.append((ep2, k, problems))
            if problems and not ks:
                above = [v for v in valid_k_values(**r) if v > k]
                if above:
                    out.append((ep2, above[0], []))
    return out


def plan(s: ModelSpec, layout: Layout, run: Run, eps=None, ks=None) -> dict:
    """The original's row and one row per proxy option (refused ones carry their reasons)."""
    check_run(run, layout)
    original = evaluate(s, layout, run)
    rows = []
    for ep2, k, problems in proxy_options(s, layout, eps, ks):
        if problems:
            rows.append({"K": k, "ep": ep2, "refused": problems})
            continue
        row = evaluate(s, target_layout(layout, ep2, k), run)
        row["cost_ratio"] = original["cost"] / row["cost"]
        row["fewer_accelerators"] = 1 - row["ranks"] / original["ranks"]
        rows.append(row)
    return {"original": original, "proxies": rows, "mtp_layers": s.mtp_layers}


def _b(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _row(name: str, r: dict) -> str:
    if "refused" in r:
        return f"| {name} | {r['K']} | {r['ep']} | refused: {'; '.join(r['refused'])} |" + " |" * 8
    m = r["memory"]
    gib = {k: m[k] / GIB for k in ("weights", "grads", "optimizer", "activations", "total")}
    ratio = f"{r['cost_ratio']:.2f}x" if "cost_ratio" in r else "1"
    fewer = f" ({r['fewer_accelerators']:.1%} fewer)" if "fewer_accelerators" in r else ""
    return (f"| {name} | {r['K']} | {r['ep']} | {r['tp']}x{r['pp']}x{r['dp']} = {r['ranks']}{fewer} | "
            f"{_b(r['params'])} | {_b(r['active'])} | {gib['weights']:.1f} / {gib['grads']:.1f} / "
            f"{gib['optimizer']:.1f} / {gib['activations']:.1f} | {gib['total']:.1f} (stage {m['stage']}) | "
            f"{'yes' if r['fits'] else 'NO'} | {r['flops_per_token'] / 1e9:.1f} | {r['step']['total']:.2f} | {ratio} |")


def describe(result: dict, s: ModelSpec, run: Run) -> str:
    """The plan as a Markdown table with its assumptions."""
    hw = run.hardware
    lines = [f"model: {s.name}: {s.num_layers} layers ({s.num_moe_layers} MoE), hidden {s.hidden}, {s.num_experts} "
             f"experts, top-{s.topk}" + (f"; {s.mtp_layers} MTP layer(s) not counted" if s.mtp_layers else ""),
             f"run: seq {run.seq_length}, micro-batch {run.micro_batch}, global batch {run.global_batch}; bf16 params, "
             f"fp32 main grads, fp32 main params + Adam m, v "
             f"({'distributed optimizer' if run.distributed_optimizer else 'not distributed'}); "
             f"{'full recompute' if run.recompute else 'no recompute'}; flash attention; sequence parallel over TP",
             f"cost model: {hw.peak_tflops:g} TFLOP/s x MFU {hw.mfu:g}, HBM {hw.hbm_gbs:g} GB/s, all-to-all "
             f"{hw.intra_gbs:g} GB/s within {hw.devices_per_node} devices / {hw.inter_gbs:g} GB/s across; "
             f"fits = total <= {USABLE:.0%} of {run.memory_gib:g} GiB",
             "",
             "| model | K | EP | TP x PP x DP = ranks | params | active/token | GiB/rank w / g / opt / act | "
             "GiB/rank total | fits | GFLOP/token | step s (est.) | cost ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|",
             _row("original", result["original"])]
    lines += [_row("proxy", r) for r in result["proxies"]]
    if not result["proxies"]:
        lines.append("(EP is 1: no smaller EP; pass --target-num-experts K to plan a proxy at EP 1)")
    if s.mtp_layers:
        rows = [("original", result["original"])] + [("proxy", r) for r in result["proxies"] if "refused" not in r]
        lines += ["", f"MTP module ({s.mtp_layers} layer(s), not in params above, as the published totals; its MoE "
                  "pruned to K like the decoder's; embedding and output layer shared): " + "; ".join(
                      f"{name} K={r['K']} EP={r['ep']}: {_b(r['mtp']['total'])} (routed experts {_b(r['mtp']['experts'])})"
                      for name, r in rows)]
    return "\n".join(lines)
