"""The conversion plan: target layout, K checked against the layout rules, kept experts per layer."""
from __future__ import annotations

import os
from typing import Callable, Optional

import numpy as np
import torch

from mindspeed_proxy.proxy.calibrate.forward import model_config_from_args, output_features
from mindspeed_proxy.proxy.calibrate.tokens import read_calibration
from mindspeed_proxy.proxy.core.errors import ConversionError, read_json_object
from mindspeed_proxy.proxy.core.layout import check_k, check_target_ep, target_layout
from mindspeed_proxy.proxy.core.options import Options
from mindspeed_proxy.proxy.core.plan_types import Plan, rules_from_args
from mindspeed_proxy.proxy.io import nonfinite
from mindspeed_proxy.proxy.io.features_file import read_features_file
from mindspeed_proxy.proxy.io.grams import weight_grams
from mindspeed_proxy.proxy.io.manifest import sha256
from mindspeed_proxy.proxy.io.protocol import SourceCheckpoint
from mindspeed_proxy.proxy.select import clustering, reconstruction, similarity


def make_plan(ckpt: SourceCheckpoint, options: Options, progress: Optional[Callable] = None) -> Plan:
    """Check K and EP2 against the checkpoint's layout, cluster every MoE layer, size the output."""
    source = ckpt.layout
    check_target_ep(source, options.target_ep)
    rules = rules_from_args(ckpt.args, source, options.target_ep)
    check_k(options.target_k, **rules)
    target = target_layout(source, options.target_ep, options.target_k)
    plan = Plan(source=source, target=target, options=options, fmt=ckpt.format)
    plan.new_args, plan.args_diff = ckpt.rewrite_config(target)  # Hugging Face: config.json fields
    check_selection_options(options, plan.fmt)
    usage = read_usage(options.usage_file, ckpt.layers, source.num_experts) if options.usage_file else {}
    nonfinite.scan_dense(ckpt)
    if _reads_data(options):  # the calibration forward, or FILE features, never see the experts' Gram
        every = range(source.num_experts)
        plan.non_finite = {l: f for l in ckpt.layers if (f := nonfinite.scan_experts(ckpt, l, every))}
        _check_non_finite(plan, options, before_forward=True)
    plan.inputs = _gather_inputs(ckpt, options, plan)
    if not usage and plan.inputs.get("calibration_usage"):
        usage = {layer: plan.inputs["calibration_usage"][layer.id] for layer in ckpt.layers}
    plan.inputs["usage_source"] = "usage-file" if options.usage_file else "calibration" if usage else None
    if (options.selection == "usage" or options.representative in ("usage", "merge") or options.usage_weighted) \
            and not usage:
        raise ConversionError("--selection usage / --representative usage|merge / --usage-weighted need "
                              "--usage-file FILE (or --features outputs with --calibration-data PATH)")
    saliency = plan.inputs.get("calibration_saliency") or {}
    layers = ckpt.layers if progress is None else progress(ckpt.layers)
    for index, layer in enumerate(layers):
        if plan.vectors:
            sim = similarity.similarity_from_vectors(plan.vectors[layer.id])
        else:
            grams = weight_grams(ckpt, layer)
            found = nonfinite.confirm(ckpt, layer, nonfinite.suspects_from_grams(grams))
            if found:
                plan.non_finite[layer] = found
                grams = nonfinite.masked_grams(grams, found)
            sim = similarity.similarity_from_parts(grams)
        if plan.non_finite and options.non_finite_experts == "refuse":
            ckpt.release()
            continue  # every layer is scanned, so that the refusal names all of them
        bad = set(plan.non_finite.get(layer, {})) if options.non_finite_experts == "exclude" else set()
        norms = router_norms(ckpt, layer) if options.selection == "cluster" and options.representative == "medoid" \
            else None
        result = _select(options, plan, layer, index, sim, options.target_k, rules["num_groups"], usage.get(layer),
                         saliency.get(layer.id), bad, norms)
        plan.kept[layer] = result["kept"]
        plan.details[layer] = result
        ckpt.release()
    _check_non_finite(plan, options)
    plan.inputs.pop("chosen", None)
    plan.bytes_to_write = ckpt.bytes_to_write(plan)
    return plan


def _forward(options: Options) -> bool:
    """True when the original model is run on calibration tokens."""
    return options.feature_type == "outputs" or options.selection == "reconstruction" or \
        options.representative == "saliency"


def _reads_data(options: Options) -> bool:
    """True when the experts are chosen from a calibration forward or a features FILE (not their Gram)."""
    return options.feature_type == "file" or _forward(options)


def _check_non_finite(plan: Plan, options: Options, before_forward: bool = False) -> None:
    """Refuse (one line) non-finite experts unless --non-finite-experts keep/exclude; a calibration forward
    cannot run on them either way (NaN/Inf would reach every later layer's features)."""
    if not plan.non_finite:
        return
    if options.non_finite_experts == "refuse":
        raise ConversionError(nonfinite.refusal(plan.non_finite))
    if before_forward and _forward(options):
        raise ConversionError(nonfinite.refusal(plan.non_finite, hint=False) + "; the calibration forward "
                              "(--features outputs, --selection reconstruction, --representative saliency) cannot "
                              "run on them: use --features weights or FILE")
    if options.representative == "merge":
        raise ConversionError("--representative merge averages experts: not with non-finite experts in the source")


def router_norms(ckpt: SourceCheckpoint, layer) -> np.ndarray:
    """[E] L2 norms of `layer`'s router rows (float64): the data-free tie-break between equal medoids."""
    return ckpt.router(layer)["weight"].to(torch.float64).norm(dim=1).numpy()


def _select(options: Options, plan: Plan, layer, index: int, sim, k: int, groups, usage, saliency,
            bad: set, norms=None) -> dict:
    """One layer's selection (kept ids, labels, ...) of `k` experts; experts in `bad` are never selected
    (`usage` / `saliency` / `norms`: this layer's per-expert lists or None)."""
    if bad:
        def run(idx, per):
            pick = lambda v: None if v is None else [v[i] for i in idx]  # noqa: E731
            return _select(options, plan, layer, index, sim[np.ix_(idx, idx)], per, None, pick(usage),
                           pick(saliency), set(), pick(norms))
        return clustering.without(sim, k, bad, groups, run)
    if options.selection == "random":
        return clustering.random_selection(sim, k, (options.seed, index), groups)
    if options.selection == "reconstruction":
        result = reconstruction.selection_result(sim, plan.inputs["chosen"][layer.id])
        result["reconstruction"]["inputs"] = options.reconstruction_inputs
        return result
    if options.selection == "usage":
        return clustering.usage_selection(sim, k, usage, groups)
    result = clustering.cluster_layer(sim, k, options.cluster, options.seed, groups, options.representative, usage,
                                      saliency, options.usage_weighted, norms)
    if options.representative == "merge":
        result["merge"] = clustering.merge_weights(result["labels"], result["kept"], usage)
    return result


def check_selection_options(options: Options, fmt: str) -> None:
    """Refuse flag combinations of the selection options that cannot work, before any data is read."""
    if options.usage_weighted and options.selection != "cluster":
        raise ConversionError(f"--usage-weighted weights the clustering; it has no meaning with --selection "
                              f"{options.selection}")
    if options.usage_weighted and options.cluster != "kmeans":
        raise ConversionError("--usage-weighted needs --cluster kmeans (the default with --usage-weighted): "
                              "average-linkage agglomerative clustering takes no sample weights")
    if options.representative in ("saliency", "merge") and options.selection != "cluster":
        raise ConversionError(f"--representative {options.representative} picks within clusters; it has no "
                              f"meaning with --selection {options.selection}")
    if options.selection == "reconstruction" and not options.calibration_data:
        raise ConversionError("--selection reconstruction needs --calibration-data PATH (the layers' outputs are "
                              "measured on calibration tokens)")
    if options.representative == "saliency" and not options.calibration_data:
        raise ConversionError("--representative saliency needs --calibration-data PATH (gate value x expert "
                              "output norm is measured on calibration tokens)")
    if options.representative == "merge" and fmt != "torch":
        raise ConversionError(f"--representative merge is implemented for legacy (torch) checkpoints only, "
                              f"not {fmt}")


def _gather_inputs(ckpt, options: Options, plan: Plan) -> dict:
    """Read the usage file / calibration data / features FILE named by `options`; fill plan.vectors."""
    inputs = {"usage_file": None, "calibration_data": None, "features_file": None, "calibration_usage": None,
              "calibration_saliency": None}
    if options.usage_file:
        inputs["usage_file"] = {"path": os.path.abspath(options.usage_file), "sha256": sha256(options.usage_file)}
    forward = options.feature_type == "outputs" or options.representative == "saliency" or \
        options.selection == "reconstruction"
    if not forward and options.calibration_data:
        raise ConversionError("--calibration-data is only used with --features outputs, --representative saliency "
                              "or --selection reconstruction")
    if forward:
        if not options.calibration_data:
            raise ConversionError("--features outputs needs --calibration-data PATH (an indexed dataset prefix, "
                                  "or a .npy / .pt file of token ids [N, S])")
        args = ckpt.args
        cfg = model_config_from_args(args, ckpt.format)  # refuse an unsupported model before reading any data
        calib = read_calibration(options.calibration_data, int(args.seq_length), cfg.vocab_size,
                                 options.calibration_sequences)
        saliency, sample, sequential = {}, None, None
        if options.selection == "reconstruction":
            reconstruction.check_size(len(ckpt.layers), ckpt.layout.num_experts, cfg.hidden_size)
            routing, groups = reconstruction.routing_config(args), getattr(args, "moe_router_num_groups", None)
            if options.reconstruction_inputs == "proxy":
                sequential = {"choose": lambda g, s: reconstruction.select(s, options.target_k, routing, groups)}
            else:
                sample = {}
        vectors, inputs["calibration_usage"], _ = output_features(ckpt, calib.tokens, saliency, sample,
                                                                  reconstruction.TOKENS, sequential)
        if sample is not None:
            inputs["chosen"] = {g: reconstruction.select(s, options.target_k, routing, groups)
                                for g, s in sample.items()}
        elif sequential is not None:
            inputs["chosen"] = sequential["kept"]
        inputs["calibration_saliency"] = saliency
        inputs["calibration_data"] = calib.describe()
        if options.feature_type == "outputs":
            plan.vectors = vectors
    if options.feature_type == "file":
        plan.vectors = read_features_file(options.features, ckpt.layers, ckpt.layout.num_experts)
        inputs["features_file"] = {"path": os.path.abspath(options.features), "sha256": sha256(options.features)}
    return inputs


def read_usage(path: str, layers, num_experts: int) -> dict:
    """{LayerRef: counts} from a JSON file {"<global layer>": [tokens routed to each global expert]}."""
    raw = read_json_object(path, f"--usage-file {path}", "an object {layer: [count per expert]}")
    out = {}
    for layer in layers:
        counts = raw.get(str(layer.id))
        if not isinstance(counts, list) or len(counts) != num_experts or \
                not all(isinstance(c, (int, float)) and c >= 0 for c in counts):
            raise ConversionError(f"--usage-file {path}: layer {layer.id} needs a list of "
                                  f"{num_experts} non-negative counts")
        out[layer] = counts
    return out


def describe(plan: Plan) -> str:
    """Human-readable plan: layouts, K, per-layer kept ids and clusters, new EP mapping, bytes to write."""
    s, t = plan.source, plan.target
    hf = plan.fmt == "hf"
    lines = [f"source: {s.num_experts} experts per MoE layer (Hugging Face checkpoint: no parallel layout)" if hf
             else f"source: {s.num_experts} experts, TP={s.tp} PP={s.pp} EP={s.ep} DP={s.dp} "
             f"({s.world_size} accelerators)",
             f"proxy:  {t.num_experts} experts per MoE layer (K checked for EP={t.ep})" if hf
             else f"proxy:  {t.num_experts} experts, TP={t.tp} PP={t.pp} EP={t.ep} DP={t.dp} "
             f"({t.world_size} accelerators)",
             f"selection={plan.options.selection} features={plan.options.features} cluster={plan.options.cluster} "
             f"representative={plan.options.representative} usage_weighted={plan.options.usage_weighted} "
             f"seed={plan.options.seed}" + ("" if plan.options.bit_exact else " (merge: NOT bit-exact)")]
    calib = plan.inputs.get("calibration_data")
    if calib:
        lines.append(f"calibration: {calib['tokens']} tokens ({calib['sequences']} x {calib['sequence_length']}) "
                     f"from {calib['path']}, sha256 {calib['tokens_sha256'][:16]}")
    if plan.inputs.get("usage_source"):
        lines.append(f"usage counts from: {plan.inputs['usage_source']}")
    if plan.non_finite:
        lines.append(f"non-finite experts ({plan.options.non_finite_experts}): " + "; ".join(
            f"{layer.name}: {sorted(found)}" for layer, found in plan.non_finite.items()))
    for layer, kept in plan.kept.items():
        d = plan.details[layer]
        lines.append(f"  {layer.name}: keep {kept}  cluster sizes {d['sizes']}  labels {d['labels']}")
    n_local = t.num_local_experts
    mapping = ", ".join(f"EP{r}: new {r * n_local}..{(r + 1) * n_local - 1}" for r in range(t.ep))
    lines.append(f"new EP mapping (new id = position in the kept list): {mapping}")
    lines.append(f"{'config.json' if hf else 'args'} changed: {plan.args_diff}")
    lines.append(f"bytes to write: {plan.bytes_to_write} ({plan.bytes_to_write / 2**20:.1f} MiB)")
    if not hf:
        lines.append(start_note(plan))
    return "\n".join(lines)


def start_note(plan: Plan) -> str:
    """How the printed launch flags start the proxy (fresh, or at the source's iteration)."""
    if not plan.options.keep_optimizer_args:
        return ("start: fresh (--finetune: iteration 0, new optimizer and LR schedule; "
                "opt_param_scheduler not kept)")
    return ("start: at the source's iteration and consumed samples (no --finetune; Adam moments and RNG dropped: "
            "--no-load-optim --no-load-rng; megatron-core 0.16 does not load opt_param_scheduler without the "
            "optimizer, so the LR schedule restarts unless the launcher restores the kept opt_param_scheduler)")


def launch_flags(plan: Plan, out_dir: str) -> str:
    """The Megatron-LM flags that load the proxy (on top of the source's model flags): its whole parallel
    layout, its expert count, the checkpoint format and how it starts. Megatron-LM refuses a legacy
    checkpoint at another TP/PP, and a torch_dist one built for other experts, so none is left implied."""
    t, args = plan.target, plan.new_args
    flags = [f"--tensor-model-parallel-size {t.tp}", f"--pipeline-model-parallel-size {t.pp}"]
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if per_stage:
        flags.append(f"--num-layers-per-virtual-pipeline-stage {per_stage}")
    elif t.vpp:
        flags.append(f"--virtual-pipeline-model-parallel-size {t.vpp}")
    flags += [f"--expert-model-parallel-size {t.ep}"]
    etp = getattr(args, "expert_tensor_parallel_size", None)
    if etp is not None and etp != t.tp:
        flags.append(f"--expert-tensor-parallel-size {etp}")
    if t.tp_extend_ep:
        flags.append("--moe-tp-extend-ep")
    flags += [f"--num-experts {t.num_experts}", f"--ckpt-format {plan.fmt}", f"--load {out_dir}"]
    if plan.fmt == "torch_dist":
        flags.append("--dist-ckpt-strictness raise_all")  # a key the proxy lacks or adds fails the load
    flags.append("--no-load-optim --no-load-rng" if plan.options.keep_optimizer_args else
                 "--finetune --no-load-optim --no-load-rng")
    return " ".join(flags)
