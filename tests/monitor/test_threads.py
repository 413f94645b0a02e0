"""single_threaded(): torch and BLAS pools at one thread inside, the previous settings back afterwards, same values.

The monitor's small linear-algebra calls got slower with more threads (docs/benchmarks.md), so the spectral
cores, the spectral families, after_optimizer_step and the router updates run single-threaded; training
itself keeps the trainer's thread count.
"""
import inspect
import threading

import pytest
import torch
from threadpoolctl import threadpool_info, threadpool_limits

from mindspeed_proxy.monitor import spectral
from mindspeed_proxy.monitor.threads import outer_threads, single_threaded


def blas_threads() -> list[int]:
    """Thread counts of every loaded BLAS library (numpy's OpenBLAS here)."""
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


@pytest.fixture
def two_threads():
    """torch and the BLAS pools at 2 threads for the test, whatever the process had before."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with threadpool_limits(2, user_api="blas"):
            assert blas_threads() and set(blas_threads()) == {2}
            yield
    finally:
        torch.set_num_threads(before)


def test_sets_one_thread_and_restores(two_threads):
    with single_threaded():
        assert torch.get_num_threads() == 1 and set(blas_threads()) == {1}
        assert outer_threads() == 2  # the trainer's count stays known inside
        with single_threaded(blas=False):  # nested: a no-op that must not restore early
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1 and set(blas_threads()) == {1}
    assert torch.get_num_threads() == 2 and set(blas_threads()) == {2}
    assert outer_threads() == 2


def test_torch_only_leaves_blas_alone(two_threads):
    with single_threaded(blas=False):
        assert torch.get_num_threads() == 1 and set(blas_threads()) == {2}
        with single_threaded():  # an inner BLAS block limits BLAS and gives it back on leaving
            assert set(blas_threads()) == {1}
        assert torch.get_num_threads() == 1 and set(blas_threads()) == {2}
    assert torch.get_num_threads() == 2 and set(blas_threads()) == {2}


def test_restored_after_an_exception(two_threads):
    with pytest.raises(RuntimeError, match="inside"):
        with single_threaded():
            with single_threaded():
                raise RuntimeError("inside")
    assert torch.get_num_threads() == 2 and set(blas_threads()) == {2}

    @single_threaded()
    def failing():
        assert torch.get_num_threads() == 1
        raise ValueError("decorated")

    with pytest.raises(ValueError, match="decorated"):
        failing()
    assert torch.get_num_threads() == 2 and set(blas_threads()) == {2}


def qk_layer(heads=4, d=256, h=32, seed=0):
    """Old/new per-head q and k blocks [heads, d, h] viewed from [heads·h, d] weights, with a rank-2 update."""
    gen = torch.Generator().manual_seed(seed)
    wq, wk = (0.02 * torch.randn(heads * h, d, generator=gen) for _ in range(2))
    dq = 2e-5 * torch.randn(heads * h, d, generator=gen) + 1e-4 * (
        torch.randn(heads, h, 2, generator=gen) @ torch.randn(heads, 2, d, generator=gen)).reshape(heads * h, d)
    dk = 2e-5 * torch.randn(heads * h, d, generator=gen)
    return [t.view(heads, h, d).mT for t in (wq, wk, wq + dq, wk + dk)]


def test_cores_run_single_threaded_and_match_the_multithreaded_result(two_threads, monkeypatch):
    layer = qk_layer()
    seen = []
    eigvalsh = torch.linalg.eigvalsh

    def spy(x, *args, **kwargs):
        seen.append((torch.get_num_threads(), tuple(blas_threads())))
        return eigvalsh(x, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigvalsh", spy)
    terms = ("delta1", "delta2", "delta3")
    got, grams = spectral.qk_increment_spectra(*layer, terms)
    assert seen and all(t == 1 and set(b) == {1} for t, b in seen)  # every eigvalsh ran on one thread
    seen.clear()
    raw = inspect.unwrap(spectral.qk_increment_spectra)  # the same core without the thread limit
    want, want_grams = raw(*layer, terms)
    assert seen and all(t == 2 and set(b) == {2} for t, b in seen)  # ... really at two threads
    assert torch.get_num_threads() == 2
    for term in terms:
        scale = want[term][..., :1]
        assert torch.allclose(got[term] / scale, want[term] / scale, rtol=0, atol=1e-5), term
    for g, w in zip(grams, want_grams):
        assert torch.allclose(g, w, rtol=1e-6, atol=0)
    # and both agree with the float64 dense SVD of the formed Δ2 (the accuracy the core is built for)
    wq, wk, wq_new, wk_new = (t.double() for t in layer)
    ref = torch.linalg.svdvals((wq_new - wq) @ wk.mT + wq @ (wk_new - wk).mT)[..., :got["delta2"].shape[-1]]
    assert ((got["delta2"].double() - ref).abs() / ref[..., :1]).max().item() < 1e-4

    delta = torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    sv = spectral.update_singular_values(delta)
    ref = torch.linalg.svdvals(delta)
    assert torch.allclose(sv, ref, rtol=1e-9, atol=1e-12)
    assert torch.get_num_threads() == 2 and set(blas_threads()) == {2}


@pytest.mark.parametrize("gqa", [False, True])
def test_heads_in_parallel_give_the_serial_result(two_threads, monkeypatch, gqa):
    wq, wk, wq_new, wk_new = qk_layer(heads=4)
    if gqa:  # 2 KV groups of 2 query heads: the key blocks broadcast over the heads of a group
        wq, wq_new = (t.unflatten(0, (2, 2)) for t in (wq, wq_new))
        wk, wk_new = (t.unflatten(0, (2, 2))[:, :1] for t in (wk, wk_new))
    terms = ("delta1", "delta2", "delta3")
    old_grams = spectral.qk_increment_spectra(wq, wk, wq, wk, ("delta3",))[1]  # a steady-state sample
    calls = []  # (thread, heads in the batch) of every eigvalsh
    eigvalsh = torch.linalg.eigvalsh

    def spy(x, *args, **kwargs):
        calls.append((threading.get_ident(), x.shape[:-2].numel()))
        assert torch.get_num_threads() == 1 and set(blas_threads()) == {1}
        return eigvalsh(x, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigvalsh", spy)
    caller = threading.get_ident()
    runs = {}
    for name, minimum in (("parallel", 0), ("serial", 1 << 62)):
        monkeypatch.setattr(spectral, "PARALLEL_MIN_ELEMENTS", minimum)
        runs[name] = []
        for grams in (None, old_grams):
            calls.clear()
            runs[name].append(spectral.qk_increment_spectra(wq, wk, wq_new, wk_new, terms, grams))
            if name == "parallel":  # two halves of the heads, each on a worker thread
                assert sorted(n for _, n in calls) == [2] * 2 * len(terms) and caller not in {t for t, _ in calls}
            else:
                assert calls == [(caller, 4)] * len(terms)
    assert torch.get_num_threads() == 2 and set(blas_threads()) == {2}
    for (par_sv, par_g), (ser_sv, ser_g) in zip(runs["parallel"], runs["serial"]):
        for term in terms:
            assert par_sv[term].shape == ser_sv[term].shape
            scale = ser_sv[term][..., :1]
            assert torch.allclose(par_sv[term] / scale, ser_sv[term] / scale, rtol=0, atol=1e-6), term
        for p, s in zip(par_g, ser_g):
            assert p.shape == s.shape and torch.allclose(p, s, rtol=1e-12, atol=0)


def monitored_threads(steps=3):
    """Train the tiny MoE at 2 torch threads with every family sampled each step; the monitor's thread counts."""
    from mindspeed_proxy.monitor import MechanismMonitor, MonitorConfig
    from mindspeed_proxy.testing.batches import synthetic_microbatches
    from mindspeed_proxy.testing.parallel import init_parallel
    from mindspeed_proxy.testing.routing import routed_to
    from mindspeed_proxy.tiny_moe import TinyMoEConfig
    from mindspeed_proxy.training.engine import TrainConfig, Trainer, microbatch_sample_ids

    torch.set_num_threads(2)
    threadpool_limits(2, user_api="blas")  # this rank's BLAS pool at 2 as well (the launcher pins one thread)
    init_parallel()
    model_cfg = TinyMoEConfig(num_layers=2)
    train_cfg = TrainConfig(micro_batch_size=2, global_batch_size=4)
    trainer = Trainer(model_cfg, train_cfg)
    monitor = MechanismMonitor(MonitorConfig(interval=1, delta=1, router_interval=1, sinks=[]), trainer.model,
                               trainer.optimizer)
    seen = {"update": [], "spectral": [], "train": []}

    def spying(name, fn):
        def wrapped(*args, **kwargs):
            seen[name].append((torch.get_num_threads(), tuple(blas_threads())))
            return fn(*args, **kwargs)
        return wrapped

    monitor.router_stats.update = spying("update", monitor.router_stats.update)
    monitor._attention_spectra = spying("spectral", monitor._attention_spectra)
    trainer.monitor = monitor
    with routed_to(monitor):
        for it in range(steps):
            batches = synthetic_microbatches(microbatch_sample_ids(train_cfg, it), model_cfg.seq_length,
                                             model_cfg.vocab_size)
            trainer.train_step(batches, iteration=it + 1)
            seen["train"].append((torch.get_num_threads(), tuple(blas_threads())))
    samples = sorted(monitor.last)
    monitor.close()
    return seen, samples, sorted(monitor.disabled)


def test_monitor_runs_single_threaded_and_training_keeps_its_threads():
    from mindspeed_proxy.testing import run_distributed

    seen, samples, disabled = run_distributed(monitored_threads, 1)[0]
    assert samples == ["attention-spectral", "router", "update-spectral"] and disabled == []
    assert seen["update"] and {t for t, _ in seen["update"]} == {1}  # router updates: torch at one thread ...
    blas_outside = {b for _, b in seen["train"]}
    assert {b for _, b in seen["update"]} == blas_outside  # ... and BLAS left as it is (blas=False)
    assert len(seen["spectral"]) == 3 and all(t == 1 and set(b) == {1} for t, b in seen["spectral"])
    assert seen["train"] == [(2, b) for _, b in seen["train"]]  # after each step: the trainer's 2 threads back
    assert all(set(b) != {1} for b in blas_outside)
