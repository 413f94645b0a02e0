"""The verification pass and the streaming writers: a proxy that holds the wrong expert, a wrong router row
or a flipped byte is refused; the writers keep only the kept experts and drop the source's pages."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from mindspeed_proxy.proxy.io import pages
from mindspeed_proxy.proxy.core.errors import ConversionError
from mindspeed_proxy.proxy.core.options import Options
from mindspeed_proxy.proxy.plan import make_plan
from mindspeed_proxy.testing import run_python

REPO = Path(__file__).resolve().parents[2]


def _swap_first_two(plan):
    """The plan with the first MoE layer's first two kept experts swapped (a wrong-mapping writer)."""
    layer = next(iter(plan.kept))
    kept = list(plan.kept[layer])
    kept[0], kept[1] = kept[1], kept[0]
    plan.kept[layer] = kept
    return plan


def _flip_byte(path, offset):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def test_legacy_verification_refuses_wrong_expert_and_flipped_byte(checkpoints, tmp_path):
    from mindspeed_proxy.proxy.convert import convert
    from mindspeed_proxy.proxy.io.legacy.reader import LegacyCheckpoint
    from mindspeed_proxy.proxy.verify.legacy import verify_legacy

    src, out = checkpoints("ep2_bias"), str(tmp_path / "proxy")
    options = Options(target_ep=1, target_k=4)
    convert(src, out, options, echo=lambda *a: None)
    assert not os.path.exists(os.path.join(out, ".scratch"))
    # the source digests, taken by the one source pass on background threads, are the plain digests
    # (XXH3-128, or SHA-256 without xxhash) of every source file, under the algorithm's name
    from mindspeed_proxy.proxy.io import hashing

    source = json.load(open(os.path.join(out, "proxy_manifest.json")))["source"]
    recorded = source["digests"]
    files = sorted(os.path.relpath(os.path.join(b, f), src) for b, _, fs in os.walk(os.path.join(src, "iter_0000002"))
                   for f in fs)
    assert source["hash"] == hashing.ALGORITHM and sorted(recorded) == files and len(files) == 2
    assert all(recorded[f] == hashing.file_digest(os.path.join(src, f)) for f in files)
    if hashing.ALGORITHM == "sha256":
        import hashlib

        assert recorded[files[0]] == hashlib.sha256(open(os.path.join(src, files[0]), "rb").read()).hexdigest()
    ckpt = LegacyCheckpoint(src)
    plan = make_plan(ckpt, options)
    assert verify_legacy(ckpt, plan, out)["experts"] == 2 * 4  # 2 MoE layers x 4 kept experts
    with pytest.raises(ConversionError, match="verification failed.*differs from source expert"):
        verify_legacy(ckpt, _swap_first_two(make_plan(ckpt, options)), out)
    # a flipped byte inside the first kept expert's weight is caught
    from mindspeed_proxy.checkpoint_io import safe_torch_load

    path = os.path.join(out, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    state = safe_torch_load(path, mmap=True)
    layer = next(iter(plan.kept))
    key = next(k for k in state["model"] if k.startswith(layer.prefix + "experts.") and k.endswith("weight"))
    needle = state["model"][key].contiguous().view(-1).view(torch.uint8).numpy().tobytes()[:64]
    del state
    data = open(path, "rb").read()
    assert data.count(needle) == 1
    _flip_byte(path, data.index(needle) + 3)
    with pytest.raises(ConversionError, match="verification failed"):
        verify_legacy(ckpt, plan, out)


def test_dist_verification_refuses_wrong_expert_and_flipped_byte(dist_checkpoints, tmp_path):
    from mindspeed_proxy.proxy.io.dist.chunks import ChunkReader
    from mindspeed_proxy.proxy.io.dist.reader import DistCheckpoint
    from mindspeed_proxy.proxy.verify.dist import verify_dist

    src, out = dist_checkpoints("ep2_bias"), str(tmp_path / "proxy")
    run = run_python([str(REPO / "convert_to_proxy.py"), "--load", src, "--save", out,
                      "--target-expert-parallel-size", "1", "--target-num-experts", "4"], timeout=300)
    assert run.returncode == 0, run.stderr
    ckpt = DistCheckpoint(src)
    try:
        options = Options(target_ep=1, target_k=4)
        plan = make_plan(ckpt, options)
        counts = verify_dist(ckpt, plan, out)
        assert counts["experts"] == 2 * 2 * 4 and counts["router_rows"] == 2 * 2 * 4  # keys x layers x K
        # the proxy keeps the source's chunking: one chunk per kept expert (and GLU half), nothing else
        folder = os.path.join(out, "iter_0000002")
        fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
        got, want = ChunkReader(folder).chunks(fc1), ChunkReader(ckpt.folder).chunks(fc1)
        assert len(got) == len(want) // 2 and {s for _, s in got} == {s for _, s in want}
        assert sorted({o[1] for o, _ in got}) == [0, 1, 2, 3]
        with pytest.raises(ConversionError, match="verification failed.*differs from source expert"):
            verify_dist(ckpt, _swap_first_two(make_plan(ckpt, options)), out)
        # flip one byte of the first kept expert's stored bytes
        reader = ChunkReader(folder)
        offsets = got[0][0]
        tensor = reader.read(fc1, offsets)
        needle = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()[:64]
        del tensor, reader
        shards = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith(".distcp")]
        shard = next(p for p in shards if needle in open(p, "rb").read())  # --workers: one file per thread
        data = open(shard, "rb").read()
        assert data.count(needle) == 1
        _flip_byte(shard, data.index(needle) + 5)
        with pytest.raises(ConversionError, match="verification failed"):
            verify_dist(ckpt, plan, out)
    finally:
        ckpt.close()


def _rss_file() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_pages_drop_only_registered_file_mappings(tmp_path):
    """drop() gives back pages of a registered memory-mapped file and leaves anonymous memory alone."""
    path = str(tmp_path / "t.pt")
    torch.save({"w": torch.arange(4 << 20, dtype=torch.float32)}, path)
    anon = torch.arange(4 << 20, dtype=torch.float32)
    mapped = torch.load(path, mmap=True, weights_only=True)["w"]
    pages.register(path)
    try:
        assert pages.mapped(mapped) and not pages.mapped(anon)
        before = mapped.sum().item()  # touches every page
        resident = _rss_file()
        pages.drop(mapped, anon)
        assert resident - _rss_file() > 8 << 20  # the 16 MiB of touched file pages left RSS
        assert mapped.sum().item() == before  # contents come back from the file
        assert torch.equal(anon, torch.arange(4 << 20, dtype=torch.float32))  # anonymous memory untouched
    finally:
        pages.unregister_all()
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_pages_find_registered_mappings_only_among_files_of_the_same_folder(tmp_path):
    """/proc/self/maps is searched by the registered files' folders: a mapped file of the same folder that
    is not registered (and one whose name extends a registered name) is never taken for a registered one, and
    each registered tensor's file offset is where its bytes are."""
    gen = torch.Generator().manual_seed(1)
    names = ["a.pt", "a.pt.bak", "b.pt"]
    saved = {name: torch.randn(1 << 16, generator=gen) for name in names}
    for name, t in saved.items():
        torch.save({"w": t}, tmp_path / name)
    loaded = {name: torch.load(tmp_path / name, mmap=True, weights_only=True)["w"] for name in names}
    pages.register(str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))
    try:
        places = pages.file_ranges([loaded[n] for n in names])
        assert places[1] is None
        for name, place in zip(names, places):
            if place is None:
                continue
            assert place[0] == os.path.realpath(tmp_path / name)
            with open(place[0], "rb") as fh:
                fh.seek(place[1])
                assert fh.read(saved[name].nbytes) == saved[name].numpy().tobytes()
        assert places[0] is not None and places[2] is not None
    finally:
        pages.unregister_all()


def test_equal_in_blocks_reads_mapped_files_without_touching_the_mappings(tmp_path):
    """Two tensors memory-mapped from registered files are compared by pread, block by block: equal ones
    pass with none of their pages resident, a byte changed in a later block (or a slice starting elsewhere)
    fails."""
    from mindspeed_proxy.proxy.verify.common import equal_in_blocks

    data = torch.randn(3 << 18, generator=torch.Generator().manual_seed(0))  # 3 MiB
    paths = [tmp_path / "a.pt", tmp_path / "b.pt"]
    for p in paths:
        torch.save({"w": data}, p)
    pages.register(*map(str, paths))
    try:
        a, b = (torch.load(p, mmap=True, weights_only=True)["w"] for p in paths)
        assert all(pages.file_ranges([a, b]))
        before = [_mapped_rss(t) for t in (a, b)]
        assert equal_in_blocks(a, b, block=1 << 18)
        after = [_mapped_rss(t) for t in (a, b)]
        assert after == before and max(after) < a.nbytes // 8, (before, after)  # pread: mappings untouched
        assert not equal_in_blocks(a[1:], b[:-1], block=1 << 18)
        c = b.clone()
        c[(5 << 16) + 3] += 1  # in the 6th block of 256 KiB
        _flip_bytes_like(paths[1], b, c)
        b2 = torch.load(paths[1], mmap=True, weights_only=True)["w"]
        assert not equal_in_blocks(a, b2, block=1 << 18) and not torch.equal(a, b2)
        assert equal_in_blocks(a[:5 << 16], b2[:5 << 16], block=1 << 18)  # the blocks before it are equal
    finally:
        pages.unregister_all()


def _flip_bytes_like(path, old, new):
    """Rewrite the stored bytes of `old` (memory-mapped from `path`) in place with those of `new`."""
    (file, offset), = pages.file_ranges([old])
    with open(file, "r+b") as fh:
        fh.seek(offset)
        fh.write(new.numpy().tobytes())


def _mapped_rss(t) -> int:
    """Resident bytes of the mapping that holds `t`'s first byte (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= t.data_ptr() < hi
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("tensor not in any mapping")
