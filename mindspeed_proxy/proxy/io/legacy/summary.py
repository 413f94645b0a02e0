"""The model tensors of a legacy checkpoint named as one global model, for the per-layer-type summary
(io/layer_summary.py): layers renumbered to global, every EP rank's expert tensors counted, the tensors every EP rank
repeats counted once. TP = 1 only (a TP shard does not say whether it is split or a replica)."""
from __future__ import annotations

import re
from typing import Optional

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def legacy_tensors(ckpt) -> Optional[dict]:
    """{global key: (shape, dtype)} of `ckpt` (a LegacyCheckpoint), None at TP > 1 or when a layer's global number
    is not known (uneven pipeline splits); expert tensors of EP rank r keep their key with `@ep{r}` appended."""
    L = ckpt.layout
    if L.tp > 1 or any(layer.global_layer is None and layer.mtp is None for layer in ckpt.layers):
        return None
    per = int(ckpt.args.num_layers) // (L.pp * len(ckpt.chunks))
    out = {}
    for pp in range(L.pp):
        for v, chunk in enumerate(ckpt.chunks):
            offset = (v * L.pp + pp) * per
            for ep in range(L.ep):
                for key, value in ckpt.state(0, pp, ep)[chunk].items():
                    if not isinstance(value, torch.Tensor):
                        continue
                    expert = ".mlp.experts." in key
                    if ep and not expert:
                        continue
                    match = _LAYER.match(key)
                    if match:
                        key = f"decoder.layers.{int(match.group(1)) + offset}." + key[match.end():]
                    out[f"{key}@ep{ep}" if expert else key] = (tuple(value.shape), value.dtype)
            ckpt.release()
    return out
