"""Sharded ΔW spectra and reduced router stats over 2 gloo ranks equal their single-process results."""
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mindspeed_proxy.monitor.router import RouterStats
from mindspeed_proxy.monitor.spectral import update_singular_values

WORLD = 2
ROW_SPLIT = [7, 5]  # uneven shards: nothing may assume equal sizes
COL_SPLIT = [3, 6]
LAYERS, EXPERTS, TOPK, TOKENS = 2, 6, 2, 40


def make_inputs():
    gen = torch.Generator().manual_seed(11)
    delta = torch.randn(sum(ROW_SPLIT), sum(COL_SPLIT), generator=gen, dtype=torch.float64)
    logits = torch.randn(LAYERS, TOKENS, EXPERTS, generator=gen)
    indices = torch.randint(0, EXPERTS, (LAYERS, TOKENS, TOPK), generator=gen)
    return delta, logits, indices


def fill_router_stats(stats, logits, indices, token_slice):
    stats.update(0, logits[0, token_slice])  # top-k derived from the logits
    stats.update(1, logits[1, token_slice], indices[1, token_slice])


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, False, timedelta(seconds=60))  # the caller's, already bound
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        group = dist.new_group(list(range(WORLD)))
        delta, logits, indices = make_inputs()
        rows = delta.split(ROW_SPLIT, dim=0)[rank]
        cols = delta.split(COL_SPLIT, dim=1)[rank]
        result = {
            "column": update_singular_values(rows, group=group, parallel_mode="column"),
            "row": update_singular_values(cols, group=group, parallel_mode="row"),
            "column32": update_singular_values(rows.float(), group=group, parallel_mode="column"),
        }
        half = TOKENS // WORLD
        stats = RouterStats(LAYERS, EXPERTS, TOPK, chunk_size=8)
        fill_router_stats(stats, logits, indices, slice(rank * half, (rank + 1) * half))
        stats.reduce([None, group])  # None entries are skipped; a second real group would double-count
        result["router"] = stats.as_tensor().clone()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_sharded_update_spectrum_and_router_reduction(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    mp.spawn(_worker, args=(store.port, str(tmp_path)), nprocs=WORLD, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    delta, logits, indices = make_inputs()
    full = update_singular_values(delta)  # unsharded: smaller (in = 9) side
    reference = torch.linalg.svdvals(delta)
    assert torch.allclose(full, reference, rtol=0, atol=1e-10 * reference[0].item())
    for res in results:
        assert res["column"].shape == (9,)
        assert torch.allclose(res["column"], full, rtol=0, atol=1e-10 * full[0].item())
        assert res["row"].shape == (12,)  # out×out Gram: 12 values, the last 3 are zero
        assert torch.allclose(res["row"][:9], full, rtol=0, atol=1e-10 * full[0].item())
        assert res["row"][9:].max() <= 1e-6 * full[0]
        assert torch.allclose(res["column32"].double(), full, rtol=0, atol=1e-4 * full[0].item())
    # a shard alone has a different spectrum: the reduction is what makes it TP-size independent
    local = update_singular_values(delta.split(ROW_SPLIT, dim=0)[0], parallel_mode="column")
    assert not torch.allclose(local, full, rtol=1e-3)

    single = RouterStats(LAYERS, EXPERTS, TOPK)
    fill_router_stats(single, logits, indices, slice(0, TOKENS))
    for res in results:
        assert torch.allclose(res["router"], single.as_tensor(), rtol=1e-6, atol=1e-5)
    reduced = RouterStats(LAYERS, EXPERTS, TOPK)
    reduced.as_tensor().copy_(results[0]["router"])
    assert reduced.summary()["tokens"].tolist() == [TOKENS] * LAYERS
    assert torch.allclose(reduced.summary()["entropy"], single.summary()["entropy"], rtol=1e-6)
