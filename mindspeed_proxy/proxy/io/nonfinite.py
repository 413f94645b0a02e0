"""Non-finite (NaN / Inf) weights in the source: found, named, and refused, kept or excluded.

Experts: with `weights` features (the default) the Gram matrix that clustering needs anyway gives every
expert's squared norm on its diagonal, so an expert holding NaN or Inf shows up at no extra read; only
such suspects are then scanned tensor by tensor to name what holds them. Other selections (features
FILE, calibration forward) scan every expert first. A router row (weight, expert_bias, bias) counts as
its expert's. Non-expert tensors the proxy copies (attention, norms, embeddings, shared experts, dense
MLPs) are scanned before anything else; no choice of experts avoids them, so they are always refused.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.core.keys import is_sliced
from mindspeed_proxy.proxy.io import pages

MODES = ("refuse", "keep", "exclude")
SHOWN = 3  # experts named in full in the refusal line


def _counts(tensor: torch.Tensor) -> Optional[tuple]:
    """(NaN count, Inf count) of a floating tensor that holds any, else None."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        return None
    finite = bool(torch.isfinite(tensor).all())
    if finite:
        pages.drop(tensor)
        return None
    nan = int(torch.isnan(tensor).sum())
    pages.drop(tensor)
    return nan, tensor.numel() - nan - int(torch.isfinite(tensor).sum())


def _where_expert(ckpt, layer, g: int, tp: int, name: str) -> str:
    if ckpt.format == "torch":
        src_tp, src_ep, local = ckpt.layout.owner(g, tp)
        return f"{layer.prefix}experts {name} of local expert {local} in {ckpt.files[(src_tp, layer.pp, src_ep)]}"
    if ckpt.format == "torch_dist":
        return f"{layer.prefix}experts.{name}[expert {g}] in {ckpt.folder}"
    return f"{layer.prefix}experts.{g}.{name}"


def router_rows(ckpt, layer) -> dict:
    """{global id: [description]} of the router entries (weight row, expert_bias, bias) holding NaN/Inf."""
    out: dict = {}
    for name, value in ckpt.router(layer).items():
        rows = value.reshape(value.shape[0], -1)
        bad = (~torch.isfinite(rows.float())).any(dim=1) if rows.is_floating_point() else torch.zeros(0, dtype=bool)
        for g in torch.nonzero(bad).flatten().tolist():
            out.setdefault(g, []).append(f"{layer.prefix}router.{name}[{g}]")
    return out


def scan_experts(ckpt, layer, ids) -> dict:
    """{global id: [description of each tensor holding NaN/Inf, with counts]} for experts `ids` of `layer`
    (every TP piece) and their router rows."""
    found = {g: rows for g, rows in router_rows(ckpt, layer).items() if g in set(ids)}
    L = ckpt.layout
    for g in ids:
        for tp in ([0] if L.tp_extend_ep else range(L.tp)):
            for name, tensor in sorted(ckpt.expert(layer, g, tp).items()):
                counts = _counts(tensor)
                if counts:
                    found.setdefault(g, []).append(f"{_where_expert(ckpt, layer, g, tp, name)}: "
                                                   f"{counts[0]} NaN, {counts[1]} Inf")
    ckpt.release()
    return found


def suspects_from_grams(grams: list) -> list:
    """Experts whose squared norm (a Gram diagonal) is not finite in any of `grams`."""
    bad = np.zeros(grams[0].shape[0], dtype=bool)
    for gram in grams:
        bad |= ~np.isfinite(np.diag(gram))
    return np.flatnonzero(bad).tolist()


def confirm(ckpt, layer, suspects: list) -> dict:
    """scan_experts over `suspects`; ConversionError for a suspect with finite values only (a float32 Gram
    overflow: weights above ~1e19 in magnitude)."""
    found = scan_experts(ckpt, layer, suspects) if suspects else {}
    for g in suspects:
        if g not in found:
            raise ConversionError(f"{layer.name} expert {g}: finite weights too large for the float32 Gram of "
                                  "--features weights (|w| above ~1e19); use --features FILE")
    return found


def masked_grams(grams: list, bad) -> list:
    """Copies of `grams` in which each expert of `bad` is unit-norm and orthogonal to every other expert
    (its non-finite row and column replaced), so that clustering sees it as unlike all others."""
    out = []
    for gram in grams:
        gram = np.array(gram, dtype=np.float64)
        for g in bad:
            gram[g, :] = 0.0
            gram[:, g] = 0.0
            gram[g, g] = 1.0
        out.append(gram)
    return out


def refusal(found: dict, hint: bool = True) -> str:
    """The one line that refuses a source with non-finite experts: every (layer, global expert id), and the
    tensors of the first few."""
    ids = "; ".join(f"{layer.name}: experts {sorted(experts)}" for layer, experts in found.items())
    shown, details = 0, []
    for layer, experts in found.items():
        for g in sorted(experts):
            if shown < SHOWN:
                details.append(f"{layer.name} expert {g}: {experts[g][0]}"
                               + (f" (+{len(experts[g]) - 1} more tensors)" if len(experts[g]) > 1 else ""))
            shown += 1
    more = f"; {shown - SHOWN} more experts" if shown > SHOWN else ""
    line = f"non-finite expert weights (NaN/Inf) in {ids} [{'; '.join(details)}{more}]"
    return line + ("; pass --non-finite-experts keep (still selectable) or exclude (never selected) to build the "
                   "proxy anyway" if hint else "")


def scan_dense(ckpt) -> None:
    """ConversionError naming the first non-expert tensor the proxy would copy that holds NaN/Inf."""
    if ckpt.format == "torch":
        items = _legacy_dense(ckpt)
    elif ckpt.format == "torch_dist":
        items = _dist_dense(ckpt)
    else:
        return
    for where, tensor in items:
        counts = _counts(tensor)
        if counts:
            ckpt.release()
            raise ConversionError(f"non-finite values in {where}: {counts[0]} NaN, {counts[1]} Inf (not an expert "
                                  "tensor: the proxy would copy it as it is, and no choice of experts avoids it; "
                                  "convert an earlier --iteration)")
    ckpt.release()


def _legacy_dense(ckpt):
    L = ckpt.layout
    for tp in range(L.tp):
        for pp in range(L.pp):
            for chunk in ckpt.chunks:
                model = ckpt.state(tp, pp, 0)[chunk]
                owned = set()
                for layer in (l for l in ckpt.layers if l.pp == pp and l.chunk == chunk):
                    owned |= set(ckpt.codec(layer).owned(model, layer.prefix + "experts."))
                    owned |= {k for k in model if k.startswith(layer.prefix + "router.")}
                for key, value in model.items():
                    if key not in owned and isinstance(value, torch.Tensor):
                        yield f"{chunk}.{key} in {ckpt.files[(tp, pp, 0)]}", value
            ckpt.release()


def _dist_dense(ckpt):
    reader = ckpt.chunk_reader()
    for key in sorted(ckpt.index.tensors):
        if is_sliced(key):
            continue
        for offsets, _ in reader.chunks(key):
            yield f"{key} (chunk at {list(offsets)}) in {ckpt.folder}", reader.read(key, offsets)
    reader.forget()
