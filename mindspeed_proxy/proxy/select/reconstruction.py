"""`--selection reconstruction`: keep the K experts whose proxy layer best reproduces the original layer.

On calibration tokens (the first TOKENS of every MoE layer's inputs, captured by the calibration forward of
`outputs.py`), the output of a proxy layer that keeps the expert set S is
y_S(x) = sum over e of p_S,e(x) * expert_e(x), where the top-k and the gate values p_S come from megatron's
own routing function (`topk_routing_with_score_function`) applied to the router logits of S only (and the
`expert_bias` entries of S): exactly how the proxy will route. Error(S) = mean over tokens of
||y_S(x) - y_E(x)||^2, y_E being the original layer with all E experts (shared experts excluded: they are
kept unchanged). Every K-subset is tried when there are at most EXHAUSTIVE of them, else greedy backward
elimination (remove, one at a time, the expert whose removal raises the error least).
Inputs (`--reconstruction-inputs`): `proxy` (default) scores layer l on the inputs that the model pruned so far
produces: one forward of the first TOKENS calibration tokens in which every MoE layer, in order, chooses its
experts and then routes over them only (so later layers see the errors of earlier ones); `original` scores
every layer on the original model's inputs (layer-local, as in Lu et al. 2024, "Not All Experts are Equal").
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from mindspeed_proxy.proxy.core.errors import ConversionError

TOKENS = 2048            # calibration tokens per layer kept for the search
EXHAUSTIVE = 5000        # at most this many K-subsets: try them all
MAX_BYTES = 4 << 30      # refuse a sample larger than this (tokens x experts x hidden x 4 bytes x layers)


def routing_config(args) -> dict:
    """The router settings that `layer_output` needs, from the checkpoint's args or a TransformerConfig."""
    return {"topk": int(getattr(args, "moe_router_topk", 2) or 1),
            "use_pre_softmax": bool(getattr(args, "moe_router_pre_softmax", False)),
            "score_function": getattr(args, "moe_router_score_function", None) or "softmax",
            "scaling_factor": getattr(args, "moe_router_topk_scaling_factor", None)}


def sequential_pass(model, gpt, tokens: torch.Tensor, choose, device) -> dict:
    """{global layer: choose(layer, sample)}: one forward of the first TOKENS calibration tokens in which each
    MoE layer, in order, chooses its kept experts on the inputs the already-pruned layers produce, then routes
    over the kept experts only (as the proxy will)."""
    from mindspeed_proxy.proxy.calibrate.forward import all_expert_outputs

    batch = tokens[:max(1, -(-TOKENS // tokens.shape[1]))].to(device)
    chosen, handles = {}, []

    def pre(g):
        def hook(module, inputs):
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            num_experts = module.router.weight.shape[0]
            sample = {"outputs": all_expert_outputs(module.experts, x, num_experts),
                      "logits": module.router.gating(x).reshape(x.shape[0], -1).float().cpu()}
            bias = getattr(module.router, "expert_bias", None)
            if bias is not None and module.config.moe_router_enable_expert_bias:
                sample["bias"] = bias.detach().float().cpu()
            chosen[g] = choose(g, sample)
        return hook

    def restrict(g):
        def hook(module, inputs, output):
            from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

            routing = routing_config(module.config)
            logits = module.gating(inputs[0]).reshape(-1, module.weight.shape[0])
            ids = torch.tensor(chosen[g][0], dtype=torch.long, device=logits.device)
            bias = getattr(module, "expert_bias", None)
            use_bias = bias is not None and module.config.moe_router_enable_expert_bias
            sub_probs, sub_map = topk_routing_with_score_function(
                logits[:, ids], routing["topk"], use_pre_softmax=routing["use_pre_softmax"],
                scaling_factor=routing["scaling_factor"], score_function=routing["score_function"],
                expert_bias=bias[ids] if use_bias else None)
            probs = torch.zeros_like(logits).index_copy(1, ids, sub_probs.to(logits.dtype))
            routing_map = torch.zeros_like(logits, dtype=torch.bool).index_copy(1, ids, sub_map)
            return probs.reshape(output[0].shape), routing_map.reshape(output[1].shape)
        return hook
    for tl in gpt.decoder.layers:
        if hasattr(tl.mlp, "router"):
            g = tl.layer_number - 1
            handles += [tl.mlp.register_forward_pre_hook(pre(g)), tl.mlp.router.register_forward_hook(restrict(g))]
    try:
        with torch.no_grad():
            model(batch, torch.arange(batch.shape[1], device=device).expand_as(batch), None)
    finally:
        for handle in handles:
            handle.remove()
    return chosen


def check_size(num_layers: int, num_experts: int, hidden: int) -> None:
    """Refuse a model whose per-token expert outputs for the search would not fit in MAX_BYTES."""
    need = num_layers * TOKENS * num_experts * hidden * 4
    if need > MAX_BYTES:
        raise ConversionError(f"--selection reconstruction: the search keeps {need / 2**30:.1f} GiB of expert "
                              f"outputs (> {MAX_BYTES / 2**30:.0f} GiB); use --selection cluster")


def layer_output(sample: dict, subset, routing: dict) -> torch.Tensor:
    """[T, H] float64 output of the layer that keeps the experts `subset` (ascending ids), on the sample."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    ids = torch.tensor(list(subset), dtype=torch.long)
    bias = sample.get("bias")
    probs, _ = topk_routing_with_score_function(
        sample["logits"][:, ids], routing["topk"], use_pre_softmax=routing["use_pre_softmax"],
        scaling_factor=routing["scaling_factor"], score_function=routing["score_function"],
        expert_bias=None if bias is None else bias[ids])
    return torch.einsum("te,teh->th", probs.double(), sample["outputs"][:, ids].double())


def select(sample: dict, k: int, routing: dict, num_groups=None) -> tuple:
    """(kept ids ascending, {"error": Error(kept), "search": "exhaustive"|"greedy"}) for one layer."""
    if num_groups and num_groups > 1:
        raise ConversionError("--selection reconstruction does not support group-limited routing "
                              "(moe_router_num_groups > 1); use --selection cluster")
    n = sample["logits"].shape[1]
    full = layer_output(sample, range(n), routing)

    def error(subset) -> float:
        return float(((layer_output(sample, subset, routing) - full) ** 2).sum(-1).mean())
    if math.comb(n, k) <= EXHAUSTIVE:
        scored = [(error(s), s) for s in itertools.combinations(range(n), k)]
        best, kept = min(scored, key=lambda t: t[0])  # first minimum: lowest ids among exact ties
        return list(kept), {"error": best, "search": "exhaustive"}
    kept = list(range(n))
    while len(kept) > k:
        trials = [(error([e for e in kept if e != drop]), drop) for drop in kept]
        kept.remove(min(trials, key=lambda t: t[0])[1])
    return kept, {"error": error(kept), "search": "greedy"}


def selection_result(similarity: np.ndarray, chosen: tuple) -> dict:
    """cluster_layer-shaped result for `chosen` = select()'s (kept, info): others labelled by their nearest kept
    expert, plus the search record."""
    from mindspeed_proxy.proxy.select.clustering import _assign_to_kept

    kept, info = chosen
    result = _assign_to_kept(similarity, kept, 1)
    result["reconstruction"] = info
    return result
