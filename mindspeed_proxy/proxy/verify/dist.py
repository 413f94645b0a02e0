"""Verify a torch_dist proxy: every chunk and object bit-equal to the source's kept experts, common state."""
from __future__ import annotations

import os

from mindspeed_proxy.proxy.core.keys import EXPERTS, expert_axis, is_sliced, is_stacked, key_layer
from mindspeed_proxy.proxy.core.plan_types import kept_of
from mindspeed_proxy.proxy.core.tracker import iteration_dir_name
from mindspeed_proxy.proxy.io.dist.chunks import ChunkReader
from mindspeed_proxy.proxy.io.dist.common import KEPT_COMMON
from mindspeed_proxy.proxy.io.dist.index import DistIndex
from mindspeed_proxy.proxy.io.dist.writer import proxy_objects
from mindspeed_proxy.proxy.select.policy import kept_fields
from mindspeed_proxy.proxy.verify.common import StreamCompare, _fail, check_args, _numel, _same_object, bit_equal, equal_in_blocks


def verify_dist(ckpt, plan, out_root: str, stream: StreamCompare = None) -> dict:
    """Check a torch_dist proxy through its own metadata: key set, global shapes, kept expert slabs and
    router rows bit-exact, every other tensor and object identical, common args rewritten, tracker. With
    `stream` (the written records' digests) stored chunks are compared by digest, not re-read."""
    folder = os.path.join(out_root, iteration_dir_name(ckpt.iteration))
    tracker = open(os.path.join(out_root, "latest_checkpointed_iteration.txt"), encoding="utf-8").read().strip()
    if tracker != str(ckpt.iteration):
        _fail(out_root, f"tracker says {tracker!r}, source iteration is {ckpt.iteration}")
    out, src = DistIndex(folder, ckpt.trust), ckpt.index
    K = plan.target.num_experts
    _verify_common(ckpt, plan, folder, out.common)
    if set(out.tensors) != set(src.tensors):
        _fail(folder, f"tensor keys differ from the source's model keys: {sorted(set(out.tensors) ^ set(src.tensors))[:4]}")
    counts = {"files": len(os.listdir(folder)), "experts": 0, "router_rows": 0, "other_tensors": 0, "objects": 0}
    got_reader, src_reader = ChunkReader(folder), ckpt.chunk_reader().sibling()
    for key, (shape, dtype) in sorted(src.tensors.items()):
        want_shape = tuple(K if is_sliced(key) and i == expert_axis(key) else n for i, n in enumerate(shape))
        if out.tensors[key] != (want_shape, dtype):
            _fail(folder, f"{key}: {out.tensors[key]}, expected {(want_shape, dtype)}")
        if is_stacked(key) and out.layers_of[key] != src.layers_of[key]:
            _fail(folder, f"{key} stored for layers {out.layers_of[key]}, source {src.layers_of[key]}")
        layers = len(src.layers_of[key]) if is_stacked(key) else 1
        _verify_chunks(plan, folder, key, want_shape, layers, got_reader, src_reader, stream or equal_in_blocks)
        if not is_sliced(key):
            counts["other_tensors"] += layers
        else:
            counts["experts" if key.startswith(EXPERTS) or ".mlp.experts." in key else "router_rows"] += K * layers
    expected = proxy_objects(ckpt, plan)
    if set(out.objects) != set(expected):
        _fail(folder, f"sharded objects differ: {sorted(set(out.objects) ^ set(expected))[:4]}")
    for name, (_, _, _, source) in expected.items():
        if not _same_object(out.object_value(name), src.object_value(source)):
            _fail(folder, f"object {name} differs from source {source}")
        counts["objects"] += 1
    if stream is not None:
        counts.update(stream.counts)
    return counts


def _verify_chunks(plan, folder, key, want_shape, layers, got_reader, src_reader, same=None) -> None:
    """Every stored chunk of proxy tensor `key` against the source region it must hold, one chunk at a
    time: unsliced chunks against the same region of the source, sliced ones expert by expert against
    the source expert the plan kept at that position; the chunks must cover the proxy tensor."""

    same = same or equal_in_blocks
    stored, total = got_reader.chunks(key), 0
    per_layer = 1
    for n in want_shape[1:] if is_stacked(key) else want_shape:
        per_layer *= n
    for offsets, sizes in stored:
        if any(o < 0 or o + n > g for o, n, g in zip(offsets, sizes, want_shape)):
            _fail(folder, f"{key}: chunk {list(offsets)}+{list(sizes)} outside {list(want_shape)}")
        total += _numel(sizes)
        if not is_sliced(key):
            if not same(got_reader.read(key, offsets), src_reader.region(key, offsets, sizes)):
                _fail(folder, f"{key} at {list(offsets)} differs from the source")
            continue
        a = expert_axis(key)
        if a and sizes[0] != 1:
            _fail(folder, f"{key}: chunk {list(offsets)}+{list(sizes)} spans several layers")
        kept = kept_of(plan, offsets[0] if a else key_layer(key))
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


def _verify_common(ckpt, plan, folder, common) -> None:
    source = ckpt.index.common
    wanted = {k for k in kept_fields(KEPT_COMMON, plan.options) if k in source}
    if set(common) != wanted:
        _fail(folder, f"common.pt keys {sorted(common)}, expected {sorted(wanted)}")
    check_args(folder, common["args"], plan, ckpt.args)
    for name in wanted - {"args"}:
        if not bit_equal(common[name], source[name]):
            _fail(folder, f"common {name} differs from the source")
