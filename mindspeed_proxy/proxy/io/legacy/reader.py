"""Read a legacy Megatron-LM checkpoint (`mp_rank_*/model_optim_rng.pt`) lazily and write a proxy of it.

Every file is opened with `mmap=True` and `weights_only=True`: tensors are paged in only when a layer's
experts are touched, so the whole model is never in memory.
"""
from __future__ import annotations

import os
import re
from typing import Optional

import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.core.keys import MTP_MLP
from mindspeed_proxy.proxy.core.layout import Layout, layout_from_args
from mindspeed_proxy.proxy.core.plan_types import Plan, rewrite_args
from mindspeed_proxy.proxy.core.refs import LayerRef
from mindspeed_proxy.proxy.core.tracker import resolve_iteration
from mindspeed_proxy.proxy.io.legacy import experts as X
from mindspeed_proxy.proxy.io.protocol import rows_by_tensor_name

FILE = "model_optim_rng.pt"
_CHUNK = re.compile(r"^model\d*$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def rank_dir_name(tp: int, pp: int, ep: int, layout: Layout) -> str:
    """`mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]` as Megatron-LM names it for `layout`."""
    name = f"mp_rank_{tp:02d}"
    if layout.pp > 1:
        name += f"_{pp:03d}"
    if layout.ep > 1:
        name += f"_{ep:03d}"
    return name


class LegacyCheckpoint:
    """The files of one iteration of a legacy checkpoint, validated against the `args` they carry."""

    format = "torch"

    def __init__(self, root: str, iteration: Optional[int] = None, trust: bool = False):
        self.root, self.trust = root, trust
        self.iteration, self.folder = resolve_iteration(root, iteration)
        names = sorted(n for n in os.listdir(self.folder) if n.startswith("mp_rank_"))
        if not names:
            raise ConversionError(f"--load {root}: {self.folder} holds no mp_rank_* folders (not a legacy "
                                  "checkpoint)")
        self._states: dict = {}
        self._codecs: dict = {}
        first = self._load(os.path.join(self.folder, names[0], FILE))
        if "args" not in first:
            raise ConversionError(f"{os.path.join(self.folder, names[0], FILE)}: no 'args' recorded")
        self.args = first["args"]
        self.layout = layout_from_args(self.args)
        L = self.layout
        self.files = {(t, p, e): os.path.join(self.folder, rank_dir_name(t, p, e, L), FILE)
                      for t in range(L.tp) for p in range(L.pp) for e in range(L.ep)}
        expected = {os.path.basename(os.path.dirname(f)) for f in self.files.values()}
        extra, missing = sorted(set(names) - expected), sorted(expected - set(names))
        if extra:
            raise ConversionError(f"{self.folder}: folder {extra[0]} does not fit the args' layout TP={L.tp} "
                                  f"PP={L.pp} EP={L.ep} (inconsistent EP/TP between files and args)")
        if missing:
            raise ConversionError(f"{self.folder}: missing shard {missing[0]} (args say TP={L.tp} PP={L.pp} "
                                  f"EP={L.ep})")
        for coord, path in self.files.items():
            if not os.path.isfile(path):
                raise ConversionError(f"missing shard {path}")
            self._check_args(path, self.state(*coord).get("args"))
        self.chunks = sorted((k for k in self.state(0, 0, 0) if _CHUNK.match(k)), key=lambda k: (len(k), k))
        if not self.chunks:
            raise ConversionError(f"{self.files[(0, 0, 0)]}: no 'model' entry")
        self.layers = self._find_layers()
        self._check_expert_counts()
        self.release()

    def _load(self, path: str) -> dict:
        try:
            return safe_torch_load(path, mmap=True, trust=self.trust)
        except ValueError as exc:  # names the file and what is wrong (refused type, truncation)
            raise ConversionError(str(exc)) from None

    def state(self, tp: int, pp: int, ep: int) -> dict:
        """The mmapped content of file (tp, pp, ep)."""
        path = self.files[(tp, pp, ep)]
        if path not in self._states:
            self._states[path] = self._load(path)
        return self._states[path]

    def release(self) -> None:
        """Drop every mmapped file (their pages leave this process's RSS once no tensor refers to them)."""
        self._states.clear()

    def _check_args(self, path: str, args) -> None:
        fields = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                  "num_experts")
        for field in fields:
            if getattr(args, field, None) != getattr(self.args, field, None):
                raise ConversionError(f"{path}: args.{field} = {getattr(args, field, None)} but other files say "
                                      f"{getattr(self.args, field, None)} (inconsistent EP/TP between files)")

    def _find_layers(self) -> list:
        L, layers = self.layout, []
        for pp in range(L.pp):
            for v, chunk in enumerate(self.chunks):
                model = self.state(0, pp, 0)[chunk]
                for key in model:
                    if not key.endswith("mlp.router.weight"):
                        continue
                    prefix = key[: -len("router.weight")]
                    mtp = MTP_MLP.match(prefix)  # multi-token prediction: `mtp.layers.{i}` of the whole model
                    layers.append(LayerRef(pp, chunk, prefix, None, int(mtp.group(1))) if mtp else
                                  LayerRef(pp, chunk, prefix, _global_layer(prefix, pp, v, L, self.args,
                                                                            len(self.chunks))))
        if not layers:
            raise ConversionError(f"--load {self.root}: no MoE layer (no mlp.router.weight) in the model")
        # VPP: v-major files; MTP layers after the decoder's
        return sorted(layers, key=lambda l: (l.mtp is not None, l.mtp or 0, l.global_layer is None,
                                             l.global_layer or 0))

    def codec(self, layer: LayerRef):
        """The expert codec of `layer` (checked in every file when opening)."""
        if layer not in self._codecs:
            model = self.state(0, layer.pp, 0)[layer.chunk]
            self._codecs[layer] = X.detect(model, layer.prefix + "experts.",
                                           f"{self.files[(0, layer.pp, 0)]} {layer.name}")
        return self._codecs[layer]

    def _check_expert_counts(self) -> None:
        n = self.layout.num_local_experts
        for layer in self.layers:
            for (tp, pp, ep), path in self.files.items():
                if pp != layer.pp:
                    continue
                model = self.state(tp, pp, ep)[layer.chunk]
                codec = X.detect(model, layer.prefix + "experts.", f"{path} {layer.name}")
                count = codec.count(model, layer.prefix + "experts.")
                if count == -1:
                    codec.get(model, layer.prefix + "experts.", 0, n)  # checks the grouped shapes
                elif count != n:
                    raise ConversionError(f"{path}: {layer.name} holds {count} local experts but args say "
                                          f"{self.layout.num_experts} experts over {self.layout.expert_shards} "
                                          "expert shards (inconsistent EP/TP between files and args)")
                rows = model[layer.prefix + "router.weight"].shape[0]
                if rows != self.layout.num_experts:
                    raise ConversionError(f"{path}: {layer.name} router has {rows} rows, args num_experts = "
                                          f"{self.layout.num_experts}")

    def expert(self, layer: LayerRef, global_id: int, tp: int) -> dict:
        """{name: tensor} of expert `global_id` as stored for TP rank `tp` (mmapped, not copied)."""
        src_tp, src_ep, local = self.layout.owner(global_id, tp)
        model = self.state(src_tp, layer.pp, src_ep)[layer.chunk]
        return self.codec(layer).get(model, layer.prefix + "experts.", local, self.layout.num_local_experts)

    def router(self, layer: LayerRef) -> dict:
        """{'weight': [E, H], 'expert_bias'?: [E], 'bias'?: [E]} of `layer` (replicated over TP/EP)."""
        model = self.state(0, layer.pp, 0)[layer.chunk]
        return {n: model[layer.prefix + "router." + n] for n in ("weight", "expert_bias", "bias")
                if isinstance(model.get(layer.prefix + "router." + n), torch.Tensor)}

    def file_paths(self) -> list:
        """Every file of this iteration (for hashing), sorted."""
        out = []
        for base, _, names in os.walk(self.folder):
            out += [os.path.join(base, n) for n in names]
        return sorted(out)


    def expert_row_groups(self, layer: LayerRef):
        """One list of E tensors per expert tensor name and TP rank (protocol.rows_by_tensor_name)."""
        return rows_by_tensor_name(self, layer)

    def rewrite_config(self, target: Layout) -> tuple:
        """A copy of the args with Megatron's expert/world fields for `target`, and the {field: [old, new]} diff."""
        return rewrite_args(self.args, target)

    def bytes_to_write(self, plan: Plan) -> int:
        """Tensor bytes of the proxy: non-expert tensors per file, K/E of the router rows, the kept experts."""
        total = 0
        src, tgt = plan.source, plan.target
        for tp in range(src.tp):
            for pp in range(src.pp):
                for chunk in self.chunks:
                    model = self.state(tp, pp, 0)[chunk]
                    layers = [l for l in self.layers if l.pp == pp and l.chunk == chunk]
                    owned = {k for l in layers for k in self.codec(l).owned(model, l.prefix + "experts.")}
                    dense = sum(_nbytes(v) for k, v in model.items() if k not in owned)
                    total += dense * tgt.ep
                    for layer in layers:
                        router = sum(_nbytes(v) for v in self.router(layer).values())
                        total -= router * tgt.ep * (src.num_experts - tgt.num_experts) // src.num_experts
                        for g in plan.kept[layer] if not (src.tp_extend_ep and tp) else []:
                            total += sum(_nbytes(v) for v in self.expert(layer, g, tp).values())
        return total

    def close(self) -> None:
        """Same as release."""
        self.release()


def _nbytes(value) -> int:
    return value.nbytes if isinstance(value, torch.Tensor) else 0


_UNEVEN_PIPELINE = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                    "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                    "account_for_loss_in_pipeline_split")


def _global_layer(prefix: str, pp: int, v: int, L: Layout, args, chunks: int) -> Optional[int]:
    """Global layer of stage `pp`, chunk `v`'s `decoder.layers.{i}.` (even split; None when uneven/unknown)."""
    match = _LAYER.search(prefix)
    num_layers = getattr(args, "num_layers", None)
    if not match or not num_layers or not prefix.startswith("decoder.") or num_layers % (L.pp * chunks):
        return None
    if any(getattr(args, name, None) for name in _UNEVEN_PIPELINE):
        return None
    per = num_layers // (L.pp * chunks)
    return v * L.pp * per + pp * per + int(match.group(1))
