"""Re-read a written Hugging Face proxy through `safetensors` and check it against the source and the plan.

Checked: the file set, config.json (only the expert counts changed, to K), index and shard key sets,
every tensor bit-exact, `total_size`, copied files. The expected key set is derived here from the
source's keys and the kept ids (not from the writer's list): kept expert `kept[j]` becomes
`experts.{j}.*`, router (`gate.*`) and fused expert tensors hold the kept rows in order, every other
tensor is the source's, bit for bit.
"""
from __future__ import annotations

import filecmp
import json
import os

import torch

from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.io import pages
from mindspeed_proxy.proxy.io.hf import layout as H
from mindspeed_proxy.proxy.io.hf.checkpoint import CONFIG, INDEX, SINGLE
from mindspeed_proxy.proxy.verify.common import equal_in_blocks


def _fail(path: str, what: str) -> None:
    raise ConversionError(f"verification failed: {path}: {what}")


def expected_tensors(ckpt, plan) -> dict:
    """{proxy key: (source key, kept rows or None, kind)} with kind 'expert', 'router' or 'other'."""
    out = {}
    special = set()
    for entry, layer in zip(ckpt.keys, ckpt.layers):
        kept = plan.kept[layer]
        for key in entry.router.values():
            out[key] = (key, kept, "router")
        for key in entry.fused.values():
            out[key] = (key, kept, "expert")
        for j, old in enumerate(kept):
            for name, key in entry.experts.get(old, {}).items():
                out[f"{entry.prefix}experts.{j}.{name}"] = (key, None, "expert")
        special |= set(entry.router.values()) | set(entry.fused.values())
        special |= {key for names in entry.experts.values() for key in names.values()}
    for key in ckpt.weight_map:
        if key not in special:
            out[key] = (key, None, "other")
    return out


def _proxy_weight_map(out_root: str, sharded: bool) -> dict:
    if not sharded:
        from safetensors import safe_open

        with safe_open(os.path.join(out_root, SINGLE), framework="pt") as fh:
            return {key: SINGLE for key in fh.keys()}
    with open(os.path.join(out_root, INDEX), encoding="utf-8") as fh:
        return json.load(fh)["weight_map"]


def verify_hf(ckpt, plan, out_root: str) -> dict:
    """Check the proxy folder against the source and plan (see the module docstring); return counts checked."""
    from safetensors import safe_open

    K = plan.target.num_experts
    config = json.load(open(os.path.join(out_root, CONFIG), encoding="utf-8"))
    want_config = {k: (K if k in H.COUNT_FIELDS and v is not None else v) for k, v in ckpt.config.items()}
    if config != want_config:
        changed = sorted(k for k in set(config) | set(want_config) if config.get(k) != want_config.get(k))
        _fail(os.path.join(out_root, CONFIG), f"fields {changed[:4]} differ from the source with K={K}")
    weight_map = _proxy_weight_map(out_root, ckpt.sharded)
    expected = expected_tensors(ckpt, plan)
    if set(weight_map) != set(expected):
        diff = sorted(set(weight_map) ^ set(expected))
        _fail(out_root, f"tensor keys differ from the expected proxy keys: {diff[:4]}")
    shards = sorted(set(weight_map.values()))
    files = {CONFIG, *shards, *ckpt.copied_files()} | ({INDEX} if ckpt.sharded else set())
    if set(os.listdir(out_root)) != files:
        _fail(out_root, f"files {sorted(os.listdir(out_root))}, expected {sorted(files)}")
    for name in ckpt.copied_files():
        if not filecmp.cmp(os.path.join(out_root, name), os.path.join(ckpt.root, name), shallow=False):
            _fail(os.path.join(out_root, name), "differs from the source's copy")
    counts = {"files": len(files), "experts": sum(len(plan.kept[layer]) for layer in ckpt.layers),
              "expert_tensors": 0, "router_rows": 0, "other_tensors": 0,
              "config_fields_changed": sum(1 for k in H.COUNT_FIELDS if ckpt.config.get(k) is not None)}
    total = 0
    for shard in shards:
        path = os.path.join(out_root, shard)
        pages.register(path)
        with safe_open(path, framework="pt") as fh:
            held = set(fh.keys())
            named = {k for k, s in weight_map.items() if s == shard}
            if held != named:
                _fail(path, f"holds {sorted(held ^ named)[:4]} not as named in the index")
            for key in sorted(held):
                got = fh.get_tensor(key)
                source, rows, kind = expected[key]
                want = ckpt.tensor(source)
                if rows is not None:
                    want = want.index_select(0, torch.tensor(rows, dtype=torch.long))
                if not equal_in_blocks(got, want):
                    _fail(path, f"{key} differs from source {source}" + (f" rows {rows}" if rows else ""))
                total += got.nbytes
                pages.drop(got, want)
                if kind == "router":
                    counts["router_rows"] += len(rows)
                elif kind == "expert":
                    counts["expert_tensors"] += 1
                else:
                    counts["other_tensors"] += 1
        ckpt.release()
    if ckpt.sharded:
        index = json.load(open(os.path.join(out_root, INDEX), encoding="utf-8"))
        if index.get("metadata", {}).get("total_size") != total:
            _fail(os.path.join(out_root, INDEX), f"total_size {index.get('metadata', {}).get('total_size')} != "
                                                 f"{total} bytes of tensors")
    return counts
