"""Write the proxy of a legacy checkpoint: one file per (TP, PP, EP) rank, forked workers, hashed as written."""
from __future__ import annotations

import os

import torch

from mindspeed_proxy.proxy.core.layout import Layout
from mindspeed_proxy.proxy.core.tracker import TRACKER, iteration_dir_name
from mindspeed_proxy.proxy.io import hashing, pages
from mindspeed_proxy.proxy.io.legacy.reader import FILE, LegacyCheckpoint, rank_dir_name
from mindspeed_proxy.proxy.select import merge
from mindspeed_proxy.proxy.select.policy import kept_fields

KEPT_FIELDS = ("args", "checkpoint_version", "iteration", "opt_param_scheduler",
               "num_floating_point_operations_so_far")
SPILL_BYTES = 1 << 20


def build_rank_state(ckpt: LegacyCheckpoint, plan, target: Layout, new_args, tp: int, pp: int, ep: int,
                     spill=None) -> dict:
    """The proxy's file (tp, pp, ep) as a state dict: non-expert entries from the source's EP rank 0,
    router rows and experts of the kept ids, optimizer / RNG / rerun state left out. Tensors built
    here (router rows, regrouped experts) go through `spill` (e.g. to a file-backed copy) if given."""
    source = ckpt.state(tp, pp, 0)
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
