"""Read a legacy Megatron-LM checkpoint (`mp_rank_*/model_optim_rng.pt`) lazily and write a proxy of it.

Every file is opened with `mmap=True` and `weights_only=True`: tensors are paged in only when a layer's
experts are touched, so the whole model is never in memory.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.proxy.io.legacy import experts as X
from mindspeed_proxy.proxy.io import hashing
from mindspeed_proxy.proxy.io import pages
from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.core.layout import Layout, layout_from_args

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"
KEPT_FIELDS = ("args", "checkpoint_version", "iteration", "opt_param_scheduler",
               "num_floating_point_operations_so_far")
SPILL_BYTES = 1 << 20
_CHUNK = re.compile(r"^model\d*$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def iteration_dir_name(iteration) -> str:
    """`iter_{:07d}`, or `release` for Megatron's release checkpoints."""
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def rank_dir_name(tp: int, pp: int, ep: int, layout: Layout) -> str:
    """`mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]` as Megatron-LM names it for `layout`."""
    name = f"mp_rank_{tp:02d}"
    if layout.pp > 1:
        name += f"_{pp:03d}"
    if layout.ep > 1:
        name += f"_{ep:03d}"
    return name


def resolve_iteration(root: str, iteration: Optional[int]):
    """The iteration to convert (from --iteration or the tracker) and its folder; ConversionError if absent."""
    if not os.path.isdir(root):
        raise ConversionError(f"--load {root}: no such directory")
    if iteration is None:
        tracker = os.path.join(root, TRACKER)
        if not os.path.isfile(tracker):
            raise ConversionError(f"--load {root}: no {TRACKER} (not a Megatron checkpoint directory)")
        text = open(tracker, encoding="utf-8").read().strip()
        if text != "release" and not text.isdigit():
            raise ConversionError(f"{tracker}: expected an iteration number or 'release', found {text!r}")
        iteration = text if text == "release" else int(text)
    folder = os.path.join(root, iteration_dir_name(iteration))
    if not os.path.isdir(folder):
        raise ConversionError(f"--load {root}: iteration {iteration} has no folder {folder}")
    return iteration, folder


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer of one pipeline stage and model chunk."""

    pp: int
    chunk: str
    prefix: str  # `decoder.layers.{i}.mlp.`
    global_layer: Optional[int]

    @property
    def name(self) -> str:
        """Readable id: global layer number when known, else stage/chunk/prefix."""
        if self.global_layer is not None:
            return f"layer {self.global_layer}"
        return f"pp{self.pp}/{self.chunk}/{self.prefix}"


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
                    if key.endswith("mlp.router.weight"):
                        prefix = key[: -len("router.weight")]
                        layers.append(MoELayer(pp, chunk, prefix, _global_layer(prefix, pp, v, L, self.args,
                                                                                  len(self.chunks))))
        if not layers:
            raise ConversionError(f"--load {self.root}: no MoE layer (no mlp.router.weight) in the model")
        return sorted(layers, key=lambda l: (l.global_layer is None, l.global_layer or 0))  # VPP: v-major files

    def codec(self, layer: MoELayer):
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

    def expert(self, layer: MoELayer, global_id: int, tp: int) -> dict:
        """{name: tensor} of expert `global_id` as stored for TP rank `tp` (mmapped, not copied)."""
        src_tp, src_ep, local = self.layout.owner(global_id, tp)
        model = self.state(src_tp, layer.pp, src_ep)[layer.chunk]
        return self.codec(layer).get(model, layer.prefix + "experts.", local, self.layout.num_local_experts)

    def router(self, layer: MoELayer) -> dict:
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


def build_rank_state(ckpt: LegacyCheckpoint, plan, target: Layout, new_args, tp: int, pp: int, ep: int,
                     spill=None) -> dict:
    """The proxy's file (tp, pp, ep) as a state dict: non-expert entries from the source's EP rank 0,
    router rows and experts of the kept ids, optimizer / RNG / rerun state left out. Tensors built
    here (router rows, regrouped experts) go through `spill` (e.g. to a file-backed copy) if given."""
    source = ckpt.state(tp, pp, 0)
    from mindspeed_proxy.proxy.select import merge
    from mindspeed_proxy.proxy.plan import kept_fields

    out = {k: source[k] for k in kept_fields(KEPT_FIELDS, plan.options) if k in source}
    out["args"] = new_args
    for chunk in ckpt.chunks:
        model = dict(source[chunk])
        for layer in (l for l in ckpt.layers if l.pp == pp and l.chunk == chunk):
            kept = plan.kept[layer]
            codec = ckpt.codec(layer)
            prefix = layer.prefix + "experts."
            for key in codec.owned(model, prefix):
                del model[key]
            for name in ("weight", "expert_bias", "bias"):
                key = layer.prefix + "router." + name
                if isinstance(model.get(key), torch.Tensor):
                    model[key] = _spilled(merge.router_rows(plan, layer, model[key]), spill)
            local_ids = [target.global_id(ep, tp, j) for j in range(target.num_local_experts)]
            pieces = [merge.expert(ckpt, plan, layer, kept[g], tp) for g in local_ids]
            built = codec.build(prefix, pieces)
            model.update({k: _spilled(_own(v), spill) for k, v in built.items()})
            del built, pieces
        out[chunk] = model
    return out


def _own(value):
    """A tensor that owns its storage (torch.save writes whole storages), else the value unchanged."""
    if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() != value.nbytes:
        return value.clone()
    return value


def _spilled(value, spill):
    """`value` through `spill` if it is a fresh (not file-mapped) tensor worth moving out of anonymous memory."""
    if spill is None or not isinstance(value, torch.Tensor) or value.nbytes < SPILL_BYTES or pages.mapped(value):
        return value
    return spill(value)


class _Spill:
    """Copies fresh tensors into scratch files mapped shared, then drops their pages: what waits in the
    state dict for torch.save is page cache, not process memory."""

    def __init__(self, folder: str):
        self.folder, self.count = folder, 0
        os.makedirs(folder, exist_ok=True)

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        path = os.path.join(self.folder, f"{self.count}.bin")
        self.count += 1
        out = torch.from_file(path, shared=True, size=value.numel(), dtype=value.dtype).view(value.shape)
        out.copy_(value)
        pages.register(path)
        pages.drop(out)
        return out


class RecordingWriter(pages.DropAfterWrite):
    """DropAfterWrite that also hashes what it writes: every write of at least MIN_RECORD bytes (torch.save
    hands each tensor record to one write) gets (file offset, size) -> digest of the bytes written, hashed
    piece by piece as each piece goes to the file."""

    MIN_RECORD = 4 << 10

    def __init__(self, fh):
        super().__init__(fh)
        self.offset, self.digests = 0, {}

    def write(self, data) -> int:
        """Write `data` fully (dropping its mapped pages piece by piece), hashing it when large."""
        view = memoryview(data)
        if not view.c_contiguous or view.nbytes < self.MIN_RECORD:
            n = super().write(data)
            self.offset += view.nbytes
            return n
        view = view.cast("B")
        h = hashing.new()
        for start in range(0, len(view), pages.WRITE_BYTES):
            piece = view[start:start + pages.WRITE_BYTES]
            h.update(piece)
            self.fh.write(piece)
            pages.drop_buffer(piece)
        self.digests[(self.offset, len(view))] = h.hexdigest()
        self.offset += len(view)
        return len(view)


def save_streaming(state: dict, path: str) -> dict:
    """torch.save `state` to `path`, dropping each memory-mapped tensor's pages once it is written; return
    {(offset, size): digest} of the large records written (RecordingWriter)."""
    with open(path, "wb") as fh:
        writer = RecordingWriter(fh)
        torch.save(state, writer)
    return writer.digests


def _write_shard(ckpt: LegacyCheckpoint, plan, target: Layout, new_args, out_root: str, coord: tuple) -> tuple:
    """Write proxy file `coord` = (tp, pp, ep); return (its path, its written-record digests)."""
    import shutil

    tp, pp, ep = coord
    rank_dir = os.path.join(out_root, iteration_dir_name(ckpt.iteration), rank_dir_name(tp, pp, ep, target))
    os.makedirs(rank_dir, exist_ok=True)
    path = os.path.join(rank_dir, FILE)
    scratch = os.path.join(out_root, f".scratch-{tp}-{pp}-{ep}")
    try:
        digests = save_streaming(build_rank_state(ckpt, plan, target, new_args, tp, pp, ep, _Spill(scratch)), path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        ckpt.release()
    return path, digests


_JOB: dict = {}  # what forked workers inherit: the checkpoint, plan and output of the conversion running


def _worker_init() -> None:
    torch.set_num_threads(1)  # each worker is one core; intra-op threads would fight the other workers


def _worker_shard(coord: tuple) -> tuple:
    job = _JOB
    return _write_shard(job["ckpt"], job["plan"], job["target"], job["new_args"], job["out_root"], coord)


def write_legacy(ckpt: LegacyCheckpoint, plan, target: Layout, new_args, out_root: str, progress=None,
                 workers: int = 1) -> dict:
    """Write every file of the proxy under `out_root` (tracker included); return {path: written-record
    digests}. Tensors stream from the mmapped sources to the file one at a time (their pages dropped after).
    With `workers` > 1 the files are written by that many forked processes, one file each at a time."""
    pages.register(*ckpt.files.values())
    coords = [(tp, pp, ep) for tp in range(target.tp) for pp in range(target.pp) for ep in range(target.ep)]
    os.makedirs(os.path.join(out_root, iteration_dir_name(ckpt.iteration)))
    written = {}
    if workers <= 1 or len(coords) == 1:
        for coord in coords:
            path, digests = _write_shard(ckpt, plan, target, new_args, out_root, coord)
            written[path] = digests
            if progress:
                progress(path)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ckpt.release()  # workers map the files they need themselves
        _JOB.update(ckpt=ckpt, plan=plan, target=target, new_args=new_args, out_root=out_root)
        try:
            with ProcessPoolExecutor(min(workers, len(coords)), multiprocessing.get_context("fork"),
                                     initializer=_worker_init) as pool:
                for path, digests in pool.map(_worker_shard, coords):
                    written[path] = digests
                    if progress:
                        progress(path)
        finally:
            _JOB.clear()
    with open(os.path.join(out_root, TRACKER), "w", encoding="utf-8") as fh:
        fh.write(str(ckpt.iteration))
    return written
