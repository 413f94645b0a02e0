"""Re-read a written proxy and check it against the source, independently of how it was built."""
from __future__ import annotations

import os

import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.proxy.select import merge
from mindspeed_proxy.proxy.io import pages
from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.io.legacy.checkpoint import FILE, KEPT_FIELDS, iteration_dir_name, rank_dir_name
from mindspeed_proxy.proxy.plan import kept_fields


def bit_equal(a, b) -> bool:
    """Same dtype, shape and bytes (NaNs included); non-tensors compared with ==."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return type(a) is type(b) and a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _fail(path: str, what: str) -> None:
    raise ConversionError(f"verification failed: {path}: {what}")


class StreamCompare:
    """Tensor equality from digests, without re-reading the written file: the proxy tensor's bytes are
    located in its file (mmap, nothing touched) and matched to the digest of that written record
    (RecordingWriter); the expected tensor's bytes are a source record whose digest the source pass took
    while reading the source (else they are hashed now). Anything else is compared byte for byte."""

    def __init__(self, written: dict, source):
        self.written = {os.path.realpath(p): d for p, d in written.items()}
        self.source = source
        self.counts = {"bytes_from_digests": 0, "source_bytes_hashed_again": 0, "bytes_compared_by_reading": 0}

    def _written_digest(self, tensor):
        where = pages.file_ranges([tensor])[0]
        if where is None:
            return None
        return self.written.get(where[0], {}).get((where[1], tensor.nbytes))

    def _source_digest(self, tensor):
        where = pages.file_ranges([tensor])[0]
        if where is None or self.source is None:
            return None
        return self.source.record(where[0], where[1], tensor.nbytes)

    def __call__(self, got, want) -> bool:
        """bit_equal(got, want), from the digests where both are known."""
        if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.dtype == want.dtype \
                and got.shape == want.shape and got.is_contiguous() and got.nbytes:
            written = self._written_digest(got)
            if written is not None:
                expected = self._source_digest(want) if want.is_contiguous() else None
                if expected is None:
                    expected = _tensor_digest(want)
                    self.counts["source_bytes_hashed_again"] += want.nbytes
                self.counts["bytes_from_digests"] += got.nbytes
                return written == expected
        if isinstance(got, torch.Tensor):
            self.counts["bytes_compared_by_reading"] += got.nbytes
        return equal_in_blocks(got, want)


def _tensor_digest(t, block: int = 4 << 20) -> str:
    """Digest of a tensor's bytes: pread from its file in blocks when it is memory-mapped from a registered
    file (the mapping never touched), else from memory."""
    from mindspeed_proxy.proxy.io import hashing

    where = pages.file_ranges([t])[0] if t.is_contiguous() else None
    if where is None:
        return hashing.digest(t.contiguous().view(-1).view(torch.uint8).numpy())
    h, buffer = hashing.new(), bytearray(min(block, t.nbytes))
    fd = os.open(where[0], os.O_RDONLY)
    try:
        for start in range(0, t.nbytes, block):
            n = min(block, t.nbytes - start)
            view = memoryview(buffer)[:n]
            pages.pread_into(fd, view, where[1] + start, where[0])
            h.update(view)
    finally:
        os.close(fd)
    return h.hexdigest()


def verify_legacy(ckpt, plan, out_root: str, stream: StreamCompare = None) -> dict:
    """Check every proxy file: key set, kept experts and router rows bit-exact (with merge: equal to the
    usage-weighted average of the cluster, recomputed), other entries identical, args rewritten; return
    counts of what was checked. With `stream` (the conversion's written-record and source digests) large
    tensors are compared by digest instead of re-reading the written bytes."""
    same = stream if stream is not None else equal_in_blocks
    src, tgt = plan.source, plan.target
    folder = os.path.join(out_root, iteration_dir_name(ckpt.iteration))
    expected_dirs = {rank_dir_name(t, p, e, tgt) for t in range(tgt.tp) for p in range(tgt.pp) for e in range(tgt.ep)}
    if set(os.listdir(folder)) != expected_dirs:
        _fail(folder, f"folders {sorted(os.listdir(folder))}, expected {sorted(expected_dirs)}")
    tracker = open(os.path.join(out_root, "latest_checkpointed_iteration.txt"), encoding="utf-8").read().strip()
    if tracker != str(ckpt.iteration):
        _fail(out_root, f"tracker says {tracker!r}, source iteration is {ckpt.iteration}")
    counts = {"files": 0, "experts": 0, "router_rows": 0, "other_tensors": 0}
    pages.register(*ckpt.files.values())
    for tp in range(tgt.tp):
        for pp in range(tgt.pp):
            for ep in range(tgt.ep):
                path = os.path.join(folder, rank_dir_name(tp, pp, ep, tgt), FILE)
                pages.register(path)  # both sides are mmapped; each compared pair's pages are dropped after
                state = safe_torch_load(path, mmap=True, trust=ckpt.trust)
                _verify_file(ckpt, plan, path, state, tp, pp, ep, counts, same)
                del state
                ckpt.release()
                counts["files"] += 1
    if stream is not None:
        counts.update(stream.counts)
    if merge.is_merge(plan):
        counts["experts_are"] = "usage-weighted merges of their clusters (not bit-exact copies)"
    return counts


def _verify_file(ckpt, plan, path, state, tp, pp, ep, counts, same=None) -> None:
    same = same or equal_in_blocks
    tgt = plan.target
    source = ckpt.state(tp, pp, 0)
    wanted = {k for k in kept_fields(KEPT_FIELDS, plan.options) if k in source} | set(ckpt.chunks)
    if set(state) != wanted:
        _fail(path, f"top-level keys {sorted(state)}, expected {sorted(wanted)}")
    args = state["args"]
    for name, value in (("num_experts", tgt.num_experts), ("expert_model_parallel_size", tgt.ep),
                        ("world_size", tgt.world_size), ("data_parallel_size", tgt.dp)):
        if getattr(args, name, None) != value:
            _fail(path, f"args.{name} = {getattr(args, name, None)}, expected {value}")
    for name, value in vars(ckpt.args).items():
        if name not in plan.args_diff and getattr(args, name, None) != value:
            _fail(path, f"args.{name} changed from {value!r} to {getattr(args, name, None)!r}")
    if state["iteration"] != source.get("iteration"):
        _fail(path, f"iteration {state['iteration']} != source {source.get('iteration')}")
    for chunk in ckpt.chunks:
        model, src_model = state[chunk], source[chunk]
        layers = [l for l in ckpt.layers if l.pp == pp and l.chunk == chunk]
        owned_src, owned_new = set(), set()
        for layer in layers:
            codec, prefix = ckpt.codec(layer), layer.prefix + "experts."
            owned_src |= set(codec.owned(src_model, prefix))
            owned_new |= set(codec.owned(model, prefix))
            n_local = tgt.num_local_experts
            for j in range(n_local):
                source_id = plan.kept[layer][tgt.global_id(ep, tp, j)]
                got = codec.get(model, prefix, j, n_local)
                want = merge.expert(ckpt, plan, layer, source_id, tp)
                if set(got) != set(want) or not all(same(got[n], want[n]) for n in want):
                    _fail(path, f"{layer.name} local expert {j} differs from source expert {source_id}")
                pages.drop(*got.values(), *want.values())
                counts["experts"] += 1
            for name, value in ckpt.router(layer).items():
                key = layer.prefix + "router." + name
                if not bit_equal(model.get(key), merge.router_rows(plan, layer, value)):
                    _fail(path, f"{key} is not the source rows {plan.kept[layer]}"
                          + (" merged by usage" if merge.is_merge(plan) else ""))
                counts["router_rows"] += len(plan.kept[layer])
        routers = {l.prefix + "router." + n for l in layers for n in ckpt.router(l)}
        rest_src = set(src_model) - owned_src - routers
        rest_new = set(model) - owned_new - routers
        if rest_src != rest_new:
            _fail(path, f"{chunk}: non-expert keys differ: {sorted(rest_src ^ rest_new)[:4]}")
        for key in rest_src:
            if not same(model[key], src_model[key]):
                _fail(path, f"{chunk}.{key} differs from the source")
            if isinstance(model[key], torch.Tensor):
                pages.drop(model[key], src_model[key])
            counts["other_tensors"] += isinstance(model[key], torch.Tensor)


def _same_object(a, b) -> bool:
    if hasattr(a, "getvalue") and hasattr(b, "getvalue"):  # io.BytesIO extra state (Transformer Engine)
        return a.getvalue() == b.getvalue()
    return bit_equal(a, b)


def verify_dist(ckpt, plan, out_root: str, stream: StreamCompare = None) -> dict:
    """Check a torch_dist proxy through its own metadata: key set, global shapes, kept expert slabs and
    router rows bit-exact, every other tensor and object identical, common args rewritten, tracker. With
    `stream` (the written records' digests) stored chunks are compared by digest, not re-read."""
    from mindspeed_proxy.proxy.io.dist import reader as D
    from mindspeed_proxy.proxy.io.dist.chunks import ChunkReader

    folder = os.path.join(out_root, iteration_dir_name(ckpt.iteration))
    tracker = open(os.path.join(out_root, "latest_checkpointed_iteration.txt"), encoding="utf-8").read().strip()
    if tracker != str(ckpt.iteration):
        _fail(out_root, f"tracker says {tracker!r}, source iteration is {ckpt.iteration}")
    out, src = D.DistIndex(folder, ckpt.trust), ckpt.index
    K = plan.target.num_experts
    _verify_common(ckpt, plan, folder, out.common)
    if set(out.tensors) != set(src.tensors):
        _fail(folder, f"tensor keys differ from the source's model keys: {sorted(set(out.tensors) ^ set(src.tensors))[:4]}")
    counts = {"files": len(os.listdir(folder)), "experts": 0, "router_rows": 0, "other_tensors": 0, "objects": 0}
    got_reader, src_reader = ChunkReader(folder), ChunkReader(ckpt.folder)
    for key, (shape, dtype) in sorted(src.tensors.items()):
        want_shape = tuple(K if D.is_sliced(key) and i == D.expert_axis(key) else n for i, n in enumerate(shape))
        if out.tensors[key] != (want_shape, dtype):
            _fail(folder, f"{key}: {out.tensors[key]}, expected {(want_shape, dtype)}")
        if D.is_stacked(key) and out.layers_of[key] != src.layers_of[key]:
            _fail(folder, f"{key} stored for layers {out.layers_of[key]}, source {src.layers_of[key]}")
        layers = len(src.layers_of[key]) if D.is_stacked(key) else 1
        _verify_chunks(plan, folder, key, want_shape, layers, got_reader, src_reader, stream or equal_in_blocks)
        if not D.is_sliced(key):
            counts["other_tensors"] += layers
        else:
            counts["experts" if key.startswith(D.EXPERTS) or ".mlp.experts." in key else "router_rows"] += K * layers
    expected = D.proxy_objects(ckpt, plan)
    if set(out.objects) != set(expected):
        _fail(folder, f"sharded objects differ: {sorted(set(out.objects) ^ set(expected))[:4]}")
    got = D.read_regions(folder, out.object_requests(sorted(expected)))
    want = D.read_regions(ckpt.folder, src.object_requests(sorted({v[3] for v in expected.values()})))
    for name, (_, _, _, source) in expected.items():
        if not _same_object(got[name], want[source]):
            _fail(folder, f"object {name} differs from source {source}")
        counts["objects"] += 1
    if stream is not None:
        counts.update(stream.counts)
    return counts


def _verify_chunks(plan, folder, key, want_shape, layers, got_reader, src_reader, same=None) -> None:
    """Every stored chunk of proxy tensor `key` against the source region it must hold, one chunk at a
    time: unsliced chunks against the same region of the source, sliced ones expert by expert against
    the source expert the plan kept at that position; the chunks must cover the proxy tensor."""
    from mindspeed_proxy.proxy.io.dist import reader as D

    same = same or equal_in_blocks
    stored, total = got_reader.chunks(key), 0
    per_layer = 1
    for n in want_shape[1:] if D.is_stacked(key) else want_shape:
        per_layer *= n
    for offsets, sizes in stored:
        if any(o < 0 or o + n > g for o, n, g in zip(offsets, sizes, want_shape)):
            _fail(folder, f"{key}: chunk {list(offsets)}+{list(sizes)} outside {list(want_shape)}")
        total += _numel(sizes)
        if not D.is_sliced(key):
            if not same(got_reader.read(key, offsets), src_reader.region(key, offsets, sizes)):
                _fail(folder, f"{key} at {list(offsets)} differs from the source")
            continue
        a = D.expert_axis(key)
        if a and sizes[0] != 1:
            _fail(folder, f"{key}: chunk {list(offsets)}+{list(sizes)} spans several layers")
        kept = D.kept_of(plan, offsets[0] if a else D.key_layer(key))
        got = got_reader.read(key, offsets)
        for j in range(offsets[a], offsets[a] + sizes[a]):
            where = offsets[:a] + (kept[j],) + offsets[a + 1:]
            want = src_reader.region(key, where, sizes[:a] + (1,) + sizes[a + 1:])
            if not same(got.narrow(a, j - offsets[a], 1), want):
                _fail(folder, f"{key} at {list(offsets)}: proxy expert {j} differs from source expert {kept[j]}")
    if total != per_layer * layers:
        _fail(folder, f"{key}: stored chunks hold {total} elements, expected {per_layer * layers}")
    got_reader.forget()
    src_reader.forget()


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def equal_in_blocks(a, b, block: int = 4 << 20) -> bool:
    """bit_equal for tensors, compared `block` bytes at a time: read with pread into two buffers when both
    are memory-mapped from registered checkpoint files (their mappings never touched), else with each
    block's mapped pages dropped once compared (so a large pair never sits in memory whole)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.nbytes <= block:
        return bit_equal(a, b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    sources = pages.file_ranges([a, b])
    if all(sources):
        return _equal_in_files(sources, a.nbytes, block)
    x, y = a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    for start in range(0, x.numel(), block):
        if not torch.equal(x[start:start + block], y[start:start + block]):
            return False
        pages.drop(x[start:start + block], y[start:start + block])
    return True


def _equal_in_files(sources, nbytes: int, block: int) -> bool:
    """The `nbytes` bytes at two (path, offset) places are equal, read `block` bytes at a time."""
    fds, bufs = [], [bytearray(min(block, nbytes)) for _ in sources]
    try:
        for path, _ in sources:
            fds.append(os.open(path, os.O_RDONLY))
        for start in range(0, nbytes, block):
            n = min(block, nbytes - start)
            for fd, buf, (path, offset) in zip(fds, bufs, sources):
                pages.pread_into(fd, memoryview(buf)[:n], offset + start, path)
            same = bufs[0] == bufs[1] if n == len(bufs[0]) else bufs[0][:n] == bufs[1][:n]  # memcmp
            if not same:
                return False
        return True
    finally:
        for fd in fds:
            os.close(fd)


def _verify_common(ckpt, plan, folder, common) -> None:
    from mindspeed_proxy.proxy.io.dist.reader import KEPT_COMMON

    tgt, source = plan.target, ckpt.index.common
    wanted = {k for k in kept_fields(KEPT_COMMON, plan.options) if k in source}
    if set(common) != wanted:
        _fail(folder, f"common.pt keys {sorted(common)}, expected {sorted(wanted)}")
    args = common["args"]
    for name, value in (("num_experts", tgt.num_experts), ("expert_model_parallel_size", tgt.ep),
                        ("world_size", tgt.world_size), ("data_parallel_size", tgt.dp)):
        if getattr(args, name, None) != value:
            _fail(folder, f"args.{name} = {getattr(args, name, None)}, expected {value}")
    for name, value in vars(ckpt.args).items():
        if name not in plan.args_diff and getattr(args, name, None) != value:
            _fail(folder, f"args.{name} changed from {value!r} to {getattr(args, name, None)!r}")
    for name in wanted - {"args"}:
        if not bit_equal(common[name], source[name]):
            _fail(folder, f"common {name} differs from the source")
