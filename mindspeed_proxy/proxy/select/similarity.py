"""Per-layer expert similarity (E x E) from features that never sit in memory whole.

`weights` (data-free): each expert's flattened weights (all TP pieces) and its router row, compared by
cosine similarity. The Gram matrix is accumulated over column blocks of the flattened weights, so
only an E x block slice is ever materialised (float32 products over 8192 columns at a time, summed in
float64: ~1e-7 relative to the float64 Gram); weights and router row get equal say (each part is
unit-normalised before they are combined).
`outputs` and features FILEs give one vector per expert ([E, D]), compared by cosine similarity
(`similarity_from_vectors`); a FILE is read and validated by `read_features_file`.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from mindspeed_proxy.proxy.io import pages

BLOCK_BYTES = 4 << 20  # the staging buffer (E x columns); source pages are dropped once copied into it
PRODUCT_COLUMNS = 8192  # float32 products run over at most this many columns before float64 accumulation


def _cosine(gram: np.ndarray) -> np.ndarray:
    norms = np.sqrt(np.clip(np.diag(gram), 1e-300, None))
    return gram / np.outer(norms, norms)


def block_gram(block: np.ndarray, columns: int = PRODUCT_COLUMNS) -> np.ndarray:
    """block @ blockᵀ as float64, from products over at most `columns` columns in the block's own dtype."""
    out = np.zeros((block.shape[0], block.shape[0]))
    for start in range(0, block.shape[1], columns):
        part = block[:, start:start + columns]
        out += part @ part.T  # float32: one BLAS syrk per slice; the running sum is float64
    return out


def streamed_gram(rows: list, block_bytes: int = BLOCK_BYTES, columns: int = PRODUCT_COLUMNS) -> np.ndarray:
    """X Xᵀ (float64) for X whose row i is `rows[i]` flattened: column blocks gathered into one float32
    buffer (float64 if a row is float64), multiplied in that dtype over `columns` columns at a time,
    summed in float64. Rows memory-mapped from a registered checkpoint file are read with pread straight
    into the buffer (their mapping is never touched); others are copied, their mapped pages dropped."""
    n = len(rows)
    flat = [r.reshape(-1) for r in rows]
    length = flat[0].numel()
    if any(f.numel() != length for f in flat):
        raise ValueError("experts of one layer have different sizes")
    dtype = torch.float64 if any(f.dtype == torch.float64 for f in flat) else torch.float32
    block = max(1, min(length, block_bytes // (dtype.itemsize * n)))
    gram = np.zeros((n, n))
    buffer = torch.empty(n, block, dtype=dtype)
    sources = pages.file_ranges(flat)
    files: dict = {}
    staging: dict = {}
    try:
        for path in {s[0] for s in sources if s}:
            files[path] = os.open(path, os.O_RDONLY)
        for start in range(0, length, block):
            width = min(block, length - start)
            for i, f in enumerate(flat):
                row = buffer[i, :width]
                if sources[i] is None:
                    piece = f[start:start + width]
                    row.copy_(piece)
                    pages.drop(piece)  # memory-mapped source pages leave RSS once read
                    continue
                path, offset = sources[i]
                if f.dtype != dtype and f.dtype not in staging:
                    staging[f.dtype] = torch.empty(block, dtype=f.dtype)
                target = row if f.dtype == dtype else staging[f.dtype][:width]
                pages.pread_into(files[path], target, offset + start * f.element_size(), path)
                if target is not row:
                    row.copy_(target)
            gram += block_gram(buffer[:, :width].numpy(), columns)
    finally:
        for fd in files.values():
            os.close(fd)
    return gram


def expert_row_groups(ckpt, layer):
    """Lists of E same-shaped tensors (one per global expert) whose Grams sum to the layer's weight Gram:
    the checkpoint's own `expert_row_groups` if it has one (torch_dist: one list per stored chunk
    region), else one list per expert tensor name and TP rank."""
    if hasattr(ckpt, "expert_row_groups"):
        yield from ckpt.expert_row_groups(layer)
        return
    L = ckpt.layout
    for tp in ([0] if L.tp_extend_ep else range(L.tp)):
        names = sorted(n for n, v in ckpt.expert(layer, 0, tp).items() if isinstance(v, torch.Tensor))
        for name in names:
            yield [ckpt.expert(layer, g, tp)[name] for g in range(L.num_experts)]


def weight_grams(ckpt, layer) -> list:
    """[E x E Gram of the flattened expert weights, E x E Gram of the router rows] (float64) of `layer`."""
    L = ckpt.layout
    gram = np.zeros((L.num_experts, L.num_experts))
    for rows in expert_row_groups(ckpt, layer):
        gram += streamed_gram(rows)
    router = ckpt.router(layer)["weight"].to(torch.float64)
    return [gram, (router @ router.T).numpy()]


def weight_similarity(ckpt, layer) -> np.ndarray:
    """E x E cosine similarity of `layer`'s experts: flattened weights (+) router rows, equally weighted."""
    return similarity_from_parts(weight_grams(ckpt, layer))


def similarity_from_parts(grams: list) -> np.ndarray:
    """Mean of the parts' cosine matrices (= cosine of the concatenated unit-normalised parts)."""
    sim = sum(_cosine(g) for g in grams) / len(grams)
    sim = (sim + sim.T) / 2
    np.fill_diagonal(sim, 1.0)
    return np.clip(sim, -1.0, 1.0)


def similarity_from_vectors(vectors: np.ndarray) -> np.ndarray:
    """Cosine similarity of the rows of `vectors` (E x D), e.g. mean expert outputs on calibration tokens."""
    v = np.asarray(vectors, dtype=np.float64)
    return similarity_from_parts([v @ v.T])


def _load_features(path: str) -> dict:
    from mindspeed_proxy.proxy.core.errors import ConversionError

    if not path.endswith((".npz", ".pt")):
        raise ConversionError(f"--features {path}: not 'weights' or 'outputs', and not a .npz / .pt features file")
    if not os.path.isfile(path):
        raise ConversionError(f"--features {path}: no such file (expected 'weights', 'outputs' or a features FILE)")
    try:
        if path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as archive:
                return {k: archive[k] for k in archive.files}
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt, truncated or pickled objects: refuse, never execute
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConversionError(f"--features {path}: cannot read ({type(exc).__name__}: {first})") from None
    if not isinstance(raw, dict):
        raise ConversionError(f"--features {path}: expected a mapping {{\"<global layer>\": [E, D] array}}, "
                              f"found {type(raw).__name__}")
    return {str(k): v.numpy() if isinstance(v, torch.Tensor) else v for k, v in raw.items()}


def read_features_file(path: str, layers: list, num_experts: int) -> dict:
    """{global layer: [E, D] float64} from a features FILE (.npz or .pt mapping "<global layer>" -> [E, D])."""
    from mindspeed_proxy.proxy.core.errors import ConversionError

    raw = _load_features(path)
    wanted = {str(layer.global_layer) for layer in layers}
    extra = sorted(set(raw) - wanted)
    if extra:
        raise ConversionError(f"--features {path}: key {extra[0]!r} is not a MoE layer of the checkpoint "
                              f"(MoE layers: {', '.join(sorted(wanted, key=int))}; global 0-based numbering)")
    out = {}
    for layer in layers:
        key = str(layer.global_layer)
        if key not in raw:
            raise ConversionError(f"--features {path}: no features for MoE layer {key}")
        value = raw[key]
        if not isinstance(value, np.ndarray) or value.ndim != 2 or value.shape[0] != num_experts \
                or value.shape[1] < 1 or not np.issubdtype(value.dtype, np.number):
            shape = list(value.shape) if isinstance(value, np.ndarray) else type(value).__name__
            raise ConversionError(f"--features {path}: layer {key} needs a numeric array [{num_experts}, D], "
                                  f"found {shape}")
        value = value.astype(np.float64)
        if not np.isfinite(value).all():
            raise ConversionError(f"--features {path}: layer {key} holds non-finite values (nan/inf)")
        out[layer.global_layer] = value
    return out


def write_features_file(path: str, vectors: dict) -> None:
    """Write {global layer: [E, D]} as a features FILE (.npz, float64), atomically (temporary name, rename)."""
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    try:
        np.savez(tmp, **{str(k): np.asarray(v, dtype=np.float64) for k, v in vectors.items()})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
