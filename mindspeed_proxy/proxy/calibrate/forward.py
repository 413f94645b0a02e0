"""The calibration forward: the original model run in this process on calibration tokens (`--features outputs`,
`--representative saliency`, `--selection reconstruction`).

The original model is built once at TP = PP = EP = 1 (world-1 gloo group, CPU platform layer when torch has
no accelerator) from the checkpoint's args, with all E experts, by `calibrate/model.py` (megatron-core's
TransformerConfig and local block spec from the args' own fields, as Megatron-LM builds it, for args of
Megatron-LM and of our trainer alike); it is loaded
with strict key checking: torch_dist through megatron's `dist_checkpointing.load` (which reshards any
source TP/PP/EP; its objects come from the records read safely, mindspeed_proxy.dist_records), legacy by
merging the EP ranks' files and PP stages / VPP chunks of TP rank 0 (legacy TP shards do not reshard, so
legacy needs TP = 1).
During the forward, a pre-hook on every MoE layer takes its input x (after the pre-MLP norm), every expert
is applied to every token (the layer's experts module called with all tokens for each expert and
probability 1) and the outputs are summed in float64; a hook on the router counts the tokens routed to
each expert (its own top-k, expert bias included). Feature of expert e = mean over tokens of expert_e(x).
REAP-like saliency of expert e (for `--representative saliency`) = mean over the tokens routed to e of
gate value (the router's output probability) x ||expert_e(x)||_2; 0 for an expert no token was routed to.
`--reconstruction-inputs proxy` runs one more forward (`sequential_pass`) in which each MoE layer chooses its
experts (select/reconstruction.py) on the inputs the already-pruned layers produce.
"""
from __future__ import annotations

import re
import warnings
from typing import Optional

import numpy as np
import torch

from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.select.reconstruction import TOKENS, routing_config

BATCH_SEQUENCES = 8
CHUNK_ELEMENTS = 1 << 24  # tokens x experts x hidden per expert call (64 MiB in fp32)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def model_config_from_args(args, checkpoint_format=None):
    """The original model's megatron-core TransformerConfig at EP = 1 (with vocab_size), from the checkpoint's own
    args (calibrate/model.py); ConversionError if this process cannot build it."""
    from mindspeed_proxy.proxy.calibrate import model as calibration_model

    return calibration_model.model_config(args, checkpoint_format)


def _renumber(key: str, offset: int) -> str:
    match = _LAYER.match(key)
    return key if match is None else f"decoder.layers.{int(match.group(1)) + offset}." + key[match.end():]


def legacy_state(ckpt) -> dict:
    """One EP = 1, PP = 1 state dict of a legacy checkpoint: every EP rank's experts, every stage's layers."""
    L = ckpt.layout
    if L.tp > 1:
        raise ConversionError(f"--features outputs: a legacy checkpoint at TP={L.tp} cannot be merged into one "
                              "process (legacy TP shards do not reshard); use its torch_dist form or --features FILE")
    num_layers = int(ckpt.args.num_layers)
    per = num_layers // (L.pp * len(ckpt.chunks))
    merged = {}
    for pp in range(L.pp):
        for v, chunk in enumerate(ckpt.chunks):
            model = ckpt.state(0, pp, 0)[chunk]
            owned, built = set(), {}
            for layer in (l for l in ckpt.layers if l.pp == pp and l.chunk == chunk):
                codec, prefix = ckpt.codec(layer), layer.prefix + "experts."
                owned.update(codec.owned(model, prefix))
                built.update(codec.build(prefix, [ckpt.expert(layer, g, 0) for g in range(L.num_experts)]))
            offset = (v * L.pp + pp) * per
            for key, value in list((k, v) for k, v in model.items() if k not in owned) + list(built.items()):
                merged[_renumber(key, offset)] = value
    return merged


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _check_fits(num_bytes: int) -> None:
    available = _available_bytes()
    if 2 * num_bytes > available:
        raise ConversionError(f"--features outputs: the original model ({num_bytes / 2**30:.1f} GiB, ~2x that "
                              f"with activations) does not fit in the {available / 2**30:.1f} GiB available; "
                              "collect features during training and pass --features FILE")


def _dist_bytes(ckpt) -> int:
    from mindspeed_proxy.proxy.core.keys import is_model_key

    return sum(int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
               for key, (shape, dtype) in ckpt.index.tensors.items() if is_model_key(key))


def _load(model, ckpt) -> None:
    from megatron.core import parallel_state as ps

    from mindspeed_proxy import dist_records

    if ckpt.format == "torch_dist":
        _check_fits(_dist_bytes(ckpt))
        metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                    "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # the checkpoint's objects were read safely when it was opened (DistIndex): megatron unpickles none
            try:
                state = dist_records.load({"model": model.sharded_state_dict(metadata=metadata)}, ckpt.folder,
                                          ckpt.trust, ckpt.index.records)
            except ValueError as exc:  # an object the model asks for is not in the checkpoint
                raise ConversionError(f"--features outputs: {exc}") from None
        state = state["model"]
    else:
        from mindspeed_proxy.proxy.calibrate import args_model
        from mindspeed_proxy.proxy.calibrate import model as calibration_model

        state = args_model.tied_output(calibration_model.model_args(ckpt.args), legacy_state(ckpt))
        _check_fits(sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor)))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()
        raise ConversionError(f"--features outputs: the checkpoint does not load into the model built from its "
                              f"args ({first[0] if first else exc}); pass --features FILE") from None


def expert_sums(experts, x: torch.Tensor, num_experts: int, norms: Optional[list] = None) -> torch.Tensor:
    """[E, H] float64: sum over the rows of x of every expert's output (and, into `norms`, the [E, rows]
    float64 L2 norms of every expert's output on every row, one chunk per item)."""
    hidden = x.shape[-1]
    rows = max(1, CHUNK_ELEMENTS // (num_experts * hidden))
    total = torch.zeros(num_experts, hidden, dtype=torch.float64)
    for start in range(0, x.shape[0], rows):
        part = x[start:start + rows]
        n = part.shape[0]
        counts = torch.full((num_experts,), n, dtype=torch.long)
        probs = torch.ones(num_experts * n, dtype=torch.float32, device=x.device)
        out, _ = experts(part.repeat(num_experts, 1), counts, probs)
        out = out.reshape(num_experts, n, hidden).to(torch.float64)
        total += out.sum(dim=1).cpu()
        if norms is not None:
            norms.append(out.norm(dim=-1).cpu())
    return total


def all_expert_outputs(experts, x: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[rows, E, H] float32 on CPU: every expert applied to every row of x (probability 1)."""
    rows = x.shape[0]
    counts = torch.full((num_experts,), rows, dtype=torch.long)
    probs = torch.ones(num_experts * rows, dtype=torch.float32, device=x.device)
    out, _ = experts(x.repeat(num_experts, 1), counts, probs)
    return out.reshape(num_experts, rows, -1).transpose(0, 1).float().cpu()


def moe_layers(gpt) -> list:
    """[(layer id, transformer layer)] of every MoE layer of a PP = 1 GPTModel: decoder layers by global number,
    then the multi-token prediction layers as `mtp.N` (LayerRef.id)."""
    layers = [(tl.layer_number - 1, tl) for tl in gpt.decoder.layers]
    mtp = getattr(gpt, "mtp", None)
    if mtp is not None:
        layers += [(f"mtp.{i}", layer.transformer_layer) for i, layer in enumerate(mtp.layers)]
    return [(g, tl) for g, tl in layers if hasattr(tl.mlp, "router")]


def run_model(model, gpt, batch: torch.Tensor, device) -> None:
    """One forward of `batch` [B, S]; with multi-token prediction, labels = the next tokens (GPTModel computes the
    MTP losses from them; the MTP layers' inputs do not depend on them)."""
    positions = torch.arange(batch.shape[1], device=device).expand_as(batch)
    labels = torch.roll(batch, -1, dims=1) if getattr(gpt, "mtp", None) is not None else None
    model(batch, positions, None, labels=labels)


class _Collector:
    """Forward hooks on every MoE layer of a PP = 1 GPTModel: expert output sums and router counts."""

    def __init__(self, gpt, num_experts: int, sample_tokens: int = 0):
        self.sums, self.usage, self.saliency, self.tokens, self.handles = {}, {}, {}, 0, []
        self.sample_tokens, self.sample, self._taken = sample_tokens, {}, {}  # --selection reconstruction
        self._norms = {}  # layer -> [E, tokens] output norms of the current forward, used by the router hook
        for g, tl in moe_layers(gpt):
            self.sums[g] = torch.zeros(num_experts, gpt.config.hidden_size, dtype=torch.float64)
            self.usage[g] = torch.zeros(num_experts, dtype=torch.float64)
            self.saliency[g] = torch.zeros(num_experts, dtype=torch.float64)
            self.handles.append(tl.mlp.register_forward_pre_hook(self._pre(g, num_experts)))
            self.handles.append(tl.mlp.router.register_forward_hook(self._routed(g)))

    def _pre(self, g: int, num_experts: int):
        def _hook(module, inputs):
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            norms = []
            self.sums[g] += expert_sums(module.experts, x, num_experts, norms)
            self._norms[g] = torch.cat(norms, dim=1)
            have = self.sample.setdefault(g, {"outputs": [], "logits": []})["outputs"]
            take = min(x.shape[0], self.sample_tokens - sum(o.shape[0] for o in have))
            self._taken[g] = max(take, 0)
            if take > 0:
                have.append(all_expert_outputs(module.experts, x[:take], num_experts))
        return _hook

    def _routed(self, g: int):
        def _hook(module, inputs, output):
            routing_map = output[1].reshape(-1, output[1].shape[-1]).cpu()
            self.usage[g] += routing_map.to(torch.float64).sum(dim=0)
            gates = output[0].reshape(routing_map.shape).to(torch.float64).cpu() * routing_map
            self.saliency[g] += (gates * self._norms.pop(g).T).sum(dim=0)
            take = self._taken.pop(g, 0)
            if take:
                x = inputs[0].reshape(-1, inputs[0].shape[-1])[:take]
                self.sample[g]["logits"].append(module.gating(x).reshape(take, -1).float().cpu())
                bias = getattr(module, "expert_bias", None)
                if bias is not None and module.config.moe_router_enable_expert_bias:
                    self.sample[g]["bias"] = bias.detach().float().cpu()
        return _hook

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self.handles:
            handle.remove()


def _parallel_world_1():
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        raise ConversionError("--features outputs: megatron's parallel state is already initialised in this "
                              "process (the converter runs the original model in its own world of 1)")
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)


def output_features(ckpt, tokens: torch.Tensor, saliency: Optional[dict] = None,
                    sample: Optional[dict] = None, sample_tokens: int = 0, sequential=None) -> tuple:
    """({global layer: [E, H] mean expert outputs}, {global layer: [E] tokens routed}, tokens used); with a
    `saliency` dict, also fills it with {global layer: [E] REAP-like saliency} (module docstring); with a
    `sample` dict, fills it with {global layer: {"outputs": [T, E, H], "logits": [T, E], "bias": [E] or
    absent}} for the first `sample_tokens` tokens (select/reconstruction.py); `sequential`: a dict whose "choose"
    (layer, sample) -> (kept, info) is called by `sequential_pass` and whose "kept" it fills."""
    from mindspeed_proxy import platform

    cfg = model_config_from_args(ckpt.args, ckpt.format)
    if any(layer.global_layer is None and layer.mtp is None for layer in ckpt.layers):
        raise ConversionError("--features outputs: the checkpoint's layer numbering is not understood")
    with platform.activated(platform.current() or ("cuda" if torch.cuda.is_available() else "cpu")):
        return _output_features(ckpt, cfg, tokens, saliency, sample, sample_tokens, sequential)


def _output_features(ckpt, cfg, tokens, saliency, sample, sample_tokens, sequential) -> tuple:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mindspeed_proxy import platform
    from mindspeed_proxy.proxy.calibrate import model as calibration_model
    from mindspeed_proxy.proxy.io.dist.group import close_group, ensure_group

    created = not dist.is_initialized()
    ensure_group()
    _parallel_world_1()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, gpt = calibration_model.build(ckpt.args, ckpt.format)
        _load(gpt, ckpt)
        ckpt.release()
        device = platform.device()
        model.to(device).eval()
        collector = _Collector(gpt, ckpt.layout.num_experts, sample_tokens if sample is not None else 0)
        try:
            with torch.no_grad():
                for start in range(0, tokens.shape[0], BATCH_SEQUENCES):
                    batch = tokens[start:start + BATCH_SEQUENCES].to(device)
                    run_model(model, gpt, batch, device)
                    collector.tokens += batch.numel()
        finally:
            collector.remove()
        if sequential is not None:
            sequential["kept"] = sequential_pass(model, gpt, tokens, sequential["choose"], device)
    finally:
        ps.destroy_model_parallel()
        if created:
            close_group()
    vectors = {g: (s / collector.tokens).numpy() for g, s in collector.sums.items()}
    usage = {g: [int(c) for c in u.tolist()] for g, u in collector.usage.items()}
    if sample is not None:
        sample.update({g: {k: torch.cat(v) if isinstance(v, list) else v for k, v in d.items()}
                       for g, d in collector.sample.items()})
    if saliency is not None:
        saliency.update({g: (collector.saliency[g] / collector.usage[g].clamp(min=1)).tolist() for g in usage})
    missing = sorted({l.id for l in ckpt.layers} - set(vectors), key=str)
    if missing:
        raise ConversionError(f"--features outputs: MoE layer {missing[0]} of the checkpoint is not an MoE layer "
                              "of the model built from its args")
    return vectors, usage, collector.tokens


def sequential_pass(model, gpt, tokens: torch.Tensor, choose, device) -> dict:
    """{global layer: choose(layer, sample)}: one forward of the first TOKENS calibration tokens in which each
    MoE layer, in order, chooses its kept experts on the inputs the already-pruned layers produce, then routes
    over the kept experts only (as the proxy will)."""
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
    for g, tl in moe_layers(gpt):
        handles += [tl.mlp.register_forward_pre_hook(pre(g)), tl.mlp.router.register_forward_hook(restrict(g))]
    try:
        with torch.no_grad():
            run_model(model, gpt, batch, device)
    finally:
        for handle in handles:
            handle.remove()
    return chosen
