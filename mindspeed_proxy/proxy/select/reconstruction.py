"""`--selection reconstruction`: keep the K experts whose proxy layer best reproduces the original layer.

On calibration tokens (the first TOKENS of every MoE layer's inputs, captured by the calibration forward of
`calibrate/forward.py`), the output of a proxy layer that keeps the expert set S is
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
from mindspeed_proxy.proxy.select.clustering import _assign_to_kept

TOKENS = 2048            # calibration tokens per layer kept for the search
EXHAUSTIVE = 5000        # at most this many K-subsets: try them all
MAX_BYTES = 4 << 30      # refuse a sample larger than this (tokens x experts x hidden x 4 bytes x layers)


def routing_config(args) -> dict:
    """The router settings that `layer_output` needs, from the checkpoint's args or a TransformerConfig."""
    return {"topk": int(getattr(args, "moe_router_topk", 2) or 1),
            "use_pre_softmax": bool(getattr(args, "moe_router_pre_softmax", False)),
            "score_function": getattr(args, "moe_router_score_function", None) or "softmax",
            "scaling_factor": getattr(args, "moe_router_topk_scaling_factor", None)}


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
    kept, info = chosen
    result = _assign_to_kept(similarity, kept, 1)
    result["reconstruction"] = info
    return result
