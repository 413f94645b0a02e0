"""The `weights` feature pass: blockwise float32 / float64-accumulated Gram against a float64 reference,
the torch_dist chunk grid, and the torch_dist pass reading chunk by chunk (never a layer slab) within
twice one tensor of memory."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mindspeed_proxy.proxy.io import grams
from mindspeed_proxy.proxy.select import similarity
from mindspeed_proxy.proxy.io.dist.chunks import layer_row_groups

REPO = Path(__file__).resolve().parents[2]


def _reference(rows):
    x = np.stack([r.reshape(-1).double().numpy() for r in rows])
    return x @ x.T


def _scaled_error(gram, ref):
    """max |G - G_ref| / (|x_i| |x_j|): the error relative to the rows' norms (what the cosine sees)."""
    norms = np.sqrt(np.diag(ref))
    return (np.abs(gram - ref) / np.outer(norms, norms)).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("block_bytes,columns", [(8 << 20, 8192), (4 * 7 * 1000, 333), (8 * 7 * 5, 3)])
def test_blockwise_gram_matches_float64_reference(dtype, block_bytes, columns):
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(300, 257, generator=gen)
    # correlated rows with different scales and offsets, so a wrong row / column pairing shows
    rows = [(base * (0.5 + i) + 0.3 * torch.randn(300, 257, generator=gen) + i / 7).to(dtype) for i in range(7)]
    gram = grams.streamed_gram(rows, block_bytes=block_bytes, columns=columns)
    scaled = _scaled_error(gram, _reference(rows))
    assert scaled < (1e-12 if dtype == torch.float64 else 1e-6), scaled
    sim, ref_sim = similarity.similarity_from_parts([gram]), similarity.similarity_from_parts([_reference(rows)])
    assert np.abs(sim - ref_sim).max() < 1e-6


def test_blockwise_gram_uses_float32_products_not_float64():
    """The float32 path really multiplies in float32 (the speed-up), yet stays within 1e-6 of float64."""
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randn(1 << 16, generator=gen) for _ in range(4)]
    ref = _reference(rows)
    gram = grams.streamed_gram(rows)
    assert not np.array_equal(gram, ref)  # float64 products would agree to the last bits here
    assert _scaled_error(gram, ref) < 1e-6


def test_gram_runs_on_one_blas_thread_and_restores_the_pool(monkeypatch):
    """The Gram's syrk calls see numpy's BLAS pool at 1 thread (a spinning second thread took the core the
    source pass needed); the pool is back at its own size afterwards, an exception included."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from mindspeed_proxy.proxy.core.layout import Layout

    def blas_threads():
        return {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}

    seen = []
    real = grams.block_gram
    monkeypatch.setattr(grams, "block_gram", lambda *a, **k: (seen.append(blas_threads()), real(*a, **k))[1])
    gen = torch.Generator().manual_seed(4)
    rows = [torch.randn(3000, generator=gen) for _ in range(4)]

    class Source:
        layout = Layout(tp=1, pp=1, ep=1, dp=1, num_experts=4)

        def expert_row_groups(self, layer):
            yield rows

        def router(self, layer):
            return {"weight": torch.stack([r[:16] for r in rows])}

    with threadpool_limits(limits=2, user_api="blas"):
        gram, _ = grams.weight_grams(Source(), None)
        assert blas_threads() == {2}
        monkeypatch.setattr(grams, "streamed_gram", lambda rows: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            grams.weight_grams(Source(), None)
        assert blas_threads() == {2}
    assert seen and all(s == {1} for s in seen)
    assert _scaled_error(gram, _reference(rows)) < 1e-6


class _FakeReader:
    """The ChunkReader interface over an in-memory global tensor cut into the given chunks."""

    def __init__(self, key, tensor, chunks):
        from types import SimpleNamespace

        self.tensor, self.list = tensor, chunks
        self.metadata = SimpleNamespace(state_dict_metadata={key: SimpleNamespace(size=tensor.shape)})
        self.reads = []

    def chunks(self, key):
        return self.list

    def read(self, key, offsets):
        self.reads.append(offsets)
        sizes = dict(self.list)[offsets]
        out = self.tensor
        for axis, (o, s) in enumerate(zip(offsets, sizes)):
            out = out.narrow(axis, o, s)
        return out.contiguous()

    def forget(self):
        pass


def _grid(shape, cuts):
    """Chunks (offsets, sizes) of a regular grid: `cuts[axis]` = list of (start, size)."""
    import itertools

    return [(tuple(c[0] for c in combo), tuple(c[1] for c in combo)) for combo in itertools.product(*cuts)]


def test_layer_row_groups_follow_the_chunk_grid():
    L, E, R, C = 3, 6, 4, 5
    tensor = torch.arange(L * E * R * C, dtype=torch.float32).reshape(L, E, R, C)
    # layers stored two-and-one, experts in chunks of 1, 2 and 3, the rows as GLU halves
    chunks = _grid(tensor.shape, [[(0, 2), (2, 1)], [(0, 1), (1, 2), (3, 3)], [(0, 2), (2, 2)], [(0, C)]])
    reader = _FakeReader("k", tensor, chunks)
    for layer in range(L):
        groups = list(layer_row_groups(reader, "k", layer, E))
        assert len(groups) == 2  # one list per stored region of the non-expert axes
        for rows, r0 in zip(groups, (0, 2)):
            assert len(rows) == E
            for e, row in enumerate(rows):
                assert torch.equal(row, tensor[layer, e, r0:r0 + 2])
        got = sum(_reference(rows) for rows in groups)
        assert np.array_equal(got, _reference([tensor[layer, e] for e in range(E)]))
    # a per-layer key [E, ...]
    flat = tensor[1].clone()
    reader = _FakeReader("p", flat, _grid(flat.shape, [[(0, 3), (3, 3)], [(0, R)], [(0, 2), (2, 3)]]))
    groups = list(layer_row_groups(reader, "p", None, E))
    assert len(groups) == 2 and all(torch.equal(groups[1][e], flat[e, :, 2:]) for e in range(E))


def test_layer_row_groups_refuse_a_non_grid_chunking():
    tensor = torch.zeros(1, 2, 4, 3)
    chunks = [((0, 0, 0, 0), (1, 1, 4, 3)), ((0, 1, 0, 0), (1, 1, 2, 3)), ((0, 1, 2, 0), (1, 1, 2, 3))]
    reader = _FakeReader("k", tensor, chunks)
    assert layer_row_groups(reader, "k", 0, 2) is None
    assert reader.reads == []  # nothing read before the refusal
    missing = _FakeReader("k", tensor, chunks[:1])  # expert 1 not stored at all
    assert layer_row_groups(missing, "k", 0, 2) is None


def test_dist_weight_features_streamed_equal_float64_reference(dist_checkpoints, monkeypatch):
    from test_proxy_dist import ITER, read_all

    from mindspeed_proxy.proxy.io.dist.reader import DistCheckpoint

    src = dist_checkpoints("ep2_bias")
    full = read_all(os.path.join(src, ITER))
    ckpt = DistCheckpoint(src)
    monkeypatch.setattr(DistCheckpoint, "layer_slabs", lambda *a: pytest.fail("read a whole layer slab"))
    try:
        for layer in ckpt.layers:
            l = layer.global_layer
            experts = [np.concatenate([full[k][l][e].reshape(-1).double().numpy() for k in sorted(full)
                                       if k.startswith("decoder.layers.mlp.experts.")]) for e in range(8)]
            x = np.stack(experts)
            router = full["decoder.layers.mlp.router.weight"][l].double().numpy()
            want = similarity.similarity_from_parts([x @ x.T, router @ router.T])
            got = grams.weight_similarity(ckpt, layer)
            assert np.abs(got - want).max() < 1e-6
            assert torch.equal(ckpt.router(layer)["weight"], full["decoder.layers.mlp.router.weight"][l])
            assert torch.equal(ckpt.router(layer)["expert_bias"], full["decoder.layers.mlp.router.expert_bias"][l])
    finally:
        ckpt.close()


def test_chunk_reader_sibling_reuses_the_parsed_layouts(dist_checkpoints, monkeypatch):
    """The writer's and the verifier's readers of the source are siblings of the feature pass's reader: a
    chunk it parsed is mapped again from the shared layout (no zip or pickle read), with the same bytes."""
    from test_proxy_dist import ITER

    from mindspeed_proxy.proxy.io.dist import chunks

    first = chunks.ChunkReader(os.path.join(dist_checkpoints("ep2_bias"), ITER))
    key = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    stored = first.chunks(key)
    want = [first.read(key, o).clone() for o, _ in stored]
    parsed = []
    real = chunks._layout
    monkeypatch.setattr(chunks, "_layout", lambda *a: parsed.append(a) or real(*a))
    second = first.sibling()
    assert second.metadata is first.metadata
    for (o, _), w in zip(stored, want):
        assert torch.equal(second.read(key, o), w)
    assert parsed == []
    other = chunks.ChunkReader(first.folder)  # a reader of its own parses again
    other.read(key, stored[0][0])
    assert len(parsed) == 1


_MEMORY = r"""
import json, os, sys
import torch, torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from mindspeed_proxy import platform
platform.activate("cpu")
root, L, E, H, F = sys.argv[1], 2, 8, 1024, 1024
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
gen = torch.Generator().manual_seed(0)
def st(key, data, shape, offset):
    return ShardedTensor(key=key, data=data, dtype=data.dtype, local_shape=tuple(data.shape), global_shape=shape,
                         global_offset=offset, axis_fragmentations=tuple(g // s for g, s in zip(shape, data.shape)),
                         replica_id=0)
exp, model = "decoder.layers.mlp.experts.experts.", {}
for l in range(L):
    model[f"r{l}"] = st("decoder.layers.mlp.router.weight", torch.randn(1, E, H, generator=gen), (L, E, H), (l, 0, 0))
    for e in range(E):
        for half in range(2):
            model[f"a{l}.{e}.{half}"] = st(exp + "linear_fc1.weight", torch.randn(1, 1, F, H, generator=gen),
                                           (L, E, 2 * F, H), (l, e, half * F, 0))
        model[f"b{l}.{e}"] = st(exp + "linear_fc2.weight", torch.randn(1, 1, H, F, generator=gen), (L, E, H, F), (l, e, 0, 0))
args = __import__("argparse").Namespace(num_experts=E, expert_model_parallel_size=1, tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1, world_size=1, data_parallel_size=1, moe_router_topk=2, num_layers=L)
os.makedirs(os.path.join(root, "iter_0000001"))
dist_checkpointing.save({"args": args, "iteration": 1, "model": model}, os.path.join(root, "iter_0000001"))
open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w").write("1")
del model
dist.destroy_process_group()
import gc; gc.collect()
from mindspeed_proxy.proxy.io import grams
from mindspeed_proxy.proxy.select import similarity
from mindspeed_proxy.proxy.io import pages
from mindspeed_proxy.proxy.io.dist.reader import DistCheckpoint
import numpy, torch.distributed.checkpoint
ckpt = DistCheckpoint(root)
pages.register(*ckpt.file_paths())
pages.pin_mmap_threshold()  # as convert._convert does
def status():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0]) * 1024
    return out
grams.weight_similarity(ckpt, ckpt.layers[0])  # warm up (lazy imports, allocator)
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
base = status()["VmRSS"]
for layer in ckpt.layers:
    grams.weight_similarity(ckpt, layer)
    ckpt.release()
print("MEM " + json.dumps({"base": base, "hwm": status()["VmHWM"], "tensor": 2 * F * H * 4, "slab": E * 3 * F * H * 4}))
"""


def test_dist_feature_pass_holds_under_two_tensors(tmp_path):
    """The torch_dist `weights` pass over 2 layers x 8 experts (fc1 8 MiB each, a layer slab 96 MiB):
    the peak RSS above the pass's start stays under twice one expert's fc1."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", _MEMORY, str(tmp_path / "ckpt")], capture_output=True, text=True,
                         env=env, timeout=600)
    line = [x for x in run.stdout.splitlines() if x.startswith("MEM ")]
    assert run.returncode == 0 and line, run.stderr[-3000:]
    mem = json.loads(line[0][4:])
    grown = mem["hwm"] - mem["base"]
    assert grown <= 2 * mem["tensor"], (grown / 2**20, mem)  # the layer-slab pass held > 96 MiB here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gram_of_memory_mapped_rows_reads_the_file(tmp_path, dtype):
    """Rows memory-mapped from a registered file are pread from their place in the file (float32 straight
    into the buffer, bfloat16 through a staging row): same Gram as the float64 reference."""
    from mindspeed_proxy.proxy.io import pages

    gen = torch.Generator().manual_seed(3)
    experts = {f"e{i}": (torch.randn(96, 50, generator=gen) + i).to(dtype) for i in range(5)}
    path = str(tmp_path / "experts.pt")
    torch.save(experts, path)
    loaded = torch.load(path, mmap=True, weights_only=True)
    rows = [loaded[f"e{i}"] for i in range(5)]
    pages.register(path)
    try:
        place = pages.file_ranges(rows)[3]
        assert place is not None and place[0] == os.path.realpath(path)
        with open(path, "rb") as fh:
            fh.seek(place[1])
            assert fh.read(rows[3].nbytes) == rows[3].contiguous().view(torch.uint8).numpy().tobytes()
        gram = grams.streamed_gram(rows, block_bytes=4 * 5 * 700, columns=256)
    finally:
        pages.unregister_all()
    assert _scaled_error(gram, _reference(rows)) < 1e-6
    assert pages.file_ranges(rows) == [None] * 5  # unregistered: copied, never pread
