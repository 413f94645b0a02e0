"""Re-read a written proxy and check it against the source, independently of how it was built."""
from __future__ import annotations

import os

import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.proxy.core.tracker import iteration_dir_name
from mindspeed_proxy.proxy.io import pages
from mindspeed_proxy.proxy.io.legacy.reader import FILE, rank_dir_name
from mindspeed_proxy.proxy.io.legacy.writer import KEPT_FIELDS
from mindspeed_proxy.proxy.select import merge
from mindspeed_proxy.proxy.select.policy import kept_fields
from mindspeed_proxy.proxy.verify.common import StreamCompare, _fail, check_args, bit_equal, equal_in_blocks


def verify_legacy(ckpt, plan, out_root: str, stream: StreamCompare = None) -> dict:
    """Check every proxy file: key set, kept experts and router rows bit-exact (with merge: equal to the
    usage-weighted average of the cluster, recomputed), other entries identical, args rewritten; return
    counts of what was checked. With `stream` (the conversion's written-record and source digests) large
    tensors are compared by digest instead of re-reading the written bytes."""
    same = stream if stream is not None else equal_in_blocks
    tgt = plan.target
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
    check_args(path, state["args"], plan, ckpt.args)
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
