"""Δ2 spectrum: compressed 2h×2h core (Gram, and the former thin-QR core) vs dense SVD of the formed d×d Δ2.

    python benchmarks/bench_qk_spectral.py [--device cpu|cuda] [--quick] [--threads N] [--profile]

Every timing runs at 1 thread and at all cores (`--threads`, default the CPU count: torch's intra-op
threads and the BLAS pools, set around each timed call), round-robin in one run, so that both see the
same load. The monitor's cores limit themselves to one thread inside (`monitor/threads.py`); the dense
SVD uses every thread it is given. The targets: ratio >= 1000x cold and steady at both counts, and the
core's time at all cores <= its time at 1 thread. `--profile` times each stage of one head's core as raw
calls (no limit) at both counts: the stages that slow down with threads.

All paths run on the same fp32 inputs in the same process. The reference is a float64 dense SVD of
Δ2 formed in float64 from those inputs. The dense 32-head layer time is extrapolated linearly from
`--dense-heads` timed heads (printed as such). Times are best-of-N wall clock (the machine may be
shared; the load average is printed). The layer is MHA (one key block per head); the GQA row times the
same 32 query heads with `--kv-groups` shared key blocks, whose Gram the core computes once per group.

The Gram core is timed twice. "cold": a first sample (or one after a snapshot retake, a load, or every
`qk_gram_reuse` samples) computes all Gram blocks. "steady": a sample whose old blocks are the previous
sample's new ones (the monitor with δ = interval) gets their Gram WᵀW from that sample, so its time
excludes the WᵀW products; the reused Gram passed in here is the exact one of the old blocks.

The GEMM bound (issue 35): the core's FLOP count (`qk_bound.core_flops`: what the code runs, fp32 d-long
products and the float64 2h×2h problem) over the throughput of torch.matmul on the core's own shapes, measured
in the same run at each thread count; the core's steady time should be <= 2x that bound. The dense-SVD
ratio stays beside it (it depends on the CPU's LAPACK as much as on the core), with the CPU named.

Spectrum relative error (the accuracy target) = max_i |σ_i − σ_ref,i| / σ_ref,i over the reference
values above the rank tolerance that `spectral_stats` applies to fp32 spectra (σ > max(2h, d)·eps_fp32·σ_max),
over the timed dense heads; the relative error of the spectral entropy H (α = 2) is reported beside it,
and so is max_i |σ_i − σ_ref,i| / σ_ref,max over all 2h values.
"""
from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager

import torch
from threadpoolctl import threadpool_limits

from mindspeed_proxy.determinism import cpu_model
from mindspeed_proxy.monitor.qk_gram import GRAM_CHUNK_ELEMENTS, factor_blocks, rows_gram, term_grams
from mindspeed_proxy.monitor.spectral import (_congruence, _psd_factor_checked, qk_increment_singular_values,
                                              qk_increment_spectra, spectral_stats, uses_sygst)
from qk_bound import bound_seconds, core_flops, gemm_throughput  # benchmarks/qk_bound.py

TARGET_RATIO = 1000.0
TARGET_ERROR = 1e-4
TARGET_BOUND = 2.0


@contextmanager
def thread_count(n: int):
    """torch's intra-op threads and the BLAS pools at `n` inside, the previous settings back afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with threadpool_limits(n, user_api="blas"):
            yield
    finally:
        torch.set_num_threads(before)


def at_threads(n: int, fn):
    """`fn` wrapped to run at `n` threads."""
    def run():
        with thread_count(n):
            return fn()
    return run


def sync(device: torch.device) -> None:
    """Wait for queued device work (CUDA) so that wall-clock timings cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats=1, warmup=0):
    """Return (result, best wall seconds, best CPU seconds of this process) over `repeats` runs after `warmup`."""
    return round_robin({"fn": fn}, device, repeats, warmup)["fn"]


def round_robin(fns: dict, device, repeats=1, warmup=1):
    """`timed` for several functions, run in turn so that they see the same load; {name: (result, wall, cpu)}."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    best = {name: [None, float("inf"), float("inf")] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            wall, cpu = time.perf_counter(), time.process_time()
            result = fn()
            sync(device)
            entry = best[name]
            entry[0] = result
            entry[1] = min(entry[1], time.perf_counter() - wall)
            entry[2] = min(entry[2], time.process_time() - cpu)
    return {name: tuple(v) for name, v in best.items()}


def dense_delta2(wq, wk, wq_new, wk_new):
    """The formed d×d Δ2 = ΔWq Wkᵀ + Wq ΔWkᵀ."""
    return (wq_new - wq) @ wk.mT + wq @ (wk_new - wk).mT


def dense_spectrum(wq, wk, wq_new, wk_new, method):
    """Singular values of the formed Δ2 by dense SVD (or eigh of its d×d Gram)."""
    delta = dense_delta2(wq, wk, wq_new, wk_new)
    if method == "svd":
        return torch.linalg.svdvals(delta)
    return torch.linalg.eigvalsh(delta.mT @ delta).clamp_min(0).sqrt().flip(-1)


def compressed_entropy(wq, wk, wq_new, wk_new, d, method="gram", old_grams=None):
    """Δ2 singular values by the compressed core (`method`; "gram" may reuse `old_grams`) and their entropy."""
    if method == "gram":
        sv = qk_increment_spectra(wq, wk, wq_new, wk_new, ("delta2",), old_grams)[0]["delta2"]
    else:
        sv = qk_increment_singular_values(wq, wk, wq_new, wk_new, term="delta2", method=method)
    return sv, spectral_stats(sv, matrix_dim=d)["entropy"]


def snapshot_grams(wq, wk):
    """The Grams (WqᵀWq, WkᵀWk) of the old blocks, as the previous sample hands them on."""
    return qk_increment_spectra(wq, wk, wq, wk, ("delta3",))[1]


def spectrum_error(sv, ref):
    """max_i |σ_i − σ_ref,i| / σ_ref,max over the leading len(sv) values."""
    ref = ref[..., : sv.shape[-1]].double()
    return ((sv.double() - ref).abs().amax(-1) / ref[..., 0]).max().item()


def relative_spectrum_error(sv, ref, d):
    """max_i |σ_i − σ_ref,i| / σ_ref,i over the reference values above the fp32 rank tolerance."""
    ref = ref[..., : sv.shape[-1]].double()
    keep = ref > max(ref.shape[-1], d) * torch.finfo(torch.float32).eps * ref[..., :1]
    return ((sv.double() - ref).abs() / ref.clamp_min(1e-300))[keep].max().item()


def profile_head(wq, wk, wq_new, wk_new, device, repeats, counts):
    """Print the best wall time of each stage of one head's Gram core, raw calls at each thread count."""
    rows = [x.mT.contiguous() for x in (wq, wk, wq_new, wk_new)]
    diffs = [rows[2] - rows[0], rows[3] - rows[1]]
    query, key = factor_blocks(wq, wq_new), factor_blocks(wk, wk_new)
    g_a, g_b = term_grams(query, key, "delta2")
    eps = torch.finfo(torch.float32).eps
    factor, lower = _psd_factor_checked(g_a, eps)
    core, uplo = _congruence(factor, g_b, lower)
    how = "sygst" if uplo == "L" else "2 GEMMs"
    stages = {
        "ΔW differences (q, k)": lambda: (rows[2] - rows[0], rows[3] - rows[1]),
        "ΔᵀΔ syrk (q, k; numpy BLAS)": lambda: [rows_gram(x) for x in diffs],
        "WᵀΔ GEMM (q, k)": lambda: [r @ x.mT for r, x in zip(rows[:2], diffs)],
        "WᵀW syrk (q, k; cold only)": lambda: [rows_gram(r) for r in rows[:2]],
        "assemble 2h×2h Grams": lambda: term_grams(query, key, "delta2"),
        "Cholesky of G_A (float64)": lambda: _psd_factor_checked(g_a, eps),
        f"core FᵀG_BF (float64, {how})": lambda: _congruence(factor, g_b, lower),
        "eigvalsh 2h×2h (float64)": lambda: torch.linalg.eigvalsh(core, UPLO=uplo),
    }
    times = round_robin({(name, n): at_threads(n, fn) for name, fn in stages.items() for n in counts}, device, repeats)
    print("\nprofile of one head, raw calls (best wall time over the runs, ms):")
    print(f"  {'stage':<30}" + "".join(f"{f'{n} thread(s)':>14}" for n in counts)
          + (f"{'ratio':>8}" if len(counts) > 1 else ""))
    for name in stages:
        walls = [times[(name, n)][1] for n in counts]
        ratio = f"{walls[-1] / walls[0]:>7.2f}x" if len(counts) > 1 else ""
        print(f"  {name:<30}" + "".join(f"{w * 1e3:>14.3f}" for w in walls) + ratio)


def print_bound(gflops, cases, counts, d, h, groups, dense_head, cpu):
    """The core's time as a multiple of its GEMM bound (qk_bound), the dense-SVD ratio beside it."""
    chunk = max(1, GRAM_CHUNK_ELEMENTS // (d * h))
    sygst = uses_sygst(torch.zeros(1, dtype=torch.float64))
    print(f"GEMM bound on {cpu} (the core's FᵀG_BF by {'LAPACK sygst' if sygst else 'two GEMMs'})")
    print("  torch.matmul on the core's shapes, measured in this run:")
    for n in counts:
        wall, cpu = gflops[n]["wall"], gflops[n]["cpu"]
        print(f"  {n} thread(s): fp32 [{chunk},{h},{d}]x[{chunk},{d},{h}] {wall['fp32']:.1f} GFLOP/s "
              f"({cpu['fp32']:.1f} per CPU-s), fp64 [{chunk},{2 * h},{2 * h}]x[{chunk},{2 * h},{2 * h}] "
              f"{wall['fp64']:.1f} GFLOP/s ({cpu['fp64']:.1f} per CPU-s)")
    print(f"core time / bound (target <= {TARGET_BOUND:.0f}x in steady state); dense SVD / core as the second ratio:")
    print(f"  {'threads':>7} {'case':<24} {'kind':<6} {'GFLOP fp32+fp64':>16} {'bound ms':>9} {'core ms':>9} "
          f"{'x bound':>8}       {'(CPU-s)':>8} {'dense/core':>10}")
    for n in counts:
        for case, times, m, prefix in cases:
            key_blocks = groups if prefix else m
            for kind in ("cold", "steady"):
                flops = core_flops(d, h, m, key_blocks, kind == "cold", core_gemms=not sygst)
                bound, core = bound_seconds(flops, gflops[n]["wall"]), times[(prefix + kind, n)][1]
                cpu_multiple = times[(prefix + kind, n)][2] / bound_seconds(flops, gflops[n]["cpu"])
                verdict = (" PASS" if core <= TARGET_BOUND * bound else " FAIL") if kind == "steady" else ""
                print(f"  {n:>7} {case:<24} {kind:<6} {flops['fp32'] / 1e9:>7.3f}+{flops['fp64'] / 1e9:<8.3f} "
                      f"{bound * 1e3:>9.2f} {core * 1e3:>9.2f} {core / bound:>7.2f}x{verdict:<5} "
                      f"{cpu_multiple:>7.2f}x {dense_head[n][0] * m / core:>9.0f}x")


def make_layer(heads, d, h, device, seed=0):
    """Per-head [heads, d, h] blocks viewed from [heads·h, d] weights, as they sit in Megatron's linear_qkv."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def weight(scale):
        """A random [heads·h, d] weight of the given scale."""
        return scale * torch.randn(heads * h, d, generator=gen)

    wq, wk = weight(0.02), weight(0.02)
    # one step of updates ~1e-3 relative, plus a coherent rank-2 query component like a biased backward
    dq = weight(2e-5) + 1e-4 * (torch.randn(heads, h, 2, generator=gen) @ torch.randn(heads, 2, d, generator=gen)
                                ).reshape(heads * h, d)
    dk = weight(2e-5)
    return [t.to(device).view(heads, h, d).mT for t in (wq, wk, wq + dq, wk + dk)]


def main(argv=None):
    """Run the benchmark at 1 thread and at all cores and print the table, ratios, targets and errors."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="d=1024, h=64, 8 heads, 1 dense head (a smoke run)")
    parser.add_argument("--d", type=int, default=None)
    parser.add_argument("--h", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--dense-heads", type=int, default=None, help="heads timed densely (rest extrapolated)")
    parser.add_argument("--dense-method", default="svd", choices=["svd", "gram-eigh"])
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="the all-cores thread count timed beside 1 thread (default: the CPU count)")
    parser.add_argument("--repeats", type=int, default=7, help="repeats of the compressed timings (best of)")
    parser.add_argument("--profile", action="store_true", help="also print each stage of one head at both counts")
    parser.add_argument("--kv-groups", type=int, default=None, help="KV groups of the GQA row (default heads/4; 0: skip)")
    args = parser.parse_args(argv)

    d = args.d or (1024 if args.quick else 4096)
    h = args.h or (64 if args.quick else 128)
    heads = args.heads or (8 if args.quick else 32)
    dense_heads = min(args.dense_heads or (1 if args.quick else 2), heads)
    device = torch.device(args.device)
    counts = sorted({1, max(1, args.threads)})
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested but CUDA is not available")
    print(f"CPU: {cpu_model()}")
    print(f"device={device} torch={torch.__version__} threads={'/'.join(map(str, counts))} "
          f"d={d} h={h} heads={heads} dtype=float32 dense={args.dense_method}")

    load_start = os.getloadavg()
    wq, wk, wq_new, wk_new = make_layer(heads, d, h, device)
    one = [t[0] for t in (wq, wk, wq_new, wk_new)]
    layer = (wq, wk, wq_new, wk_new)
    layer_repeats = max(1, args.repeats // 2)

    groups = heads // 4 if args.kv_groups is None else args.kv_groups
    groups = groups if 0 < groups < heads and heads % groups == 0 else 0
    grams_one, grams_layer = snapshot_grams(*one[:2]), snapshot_grams(*layer[:2])
    head_fns = {"cold": lambda: compressed_entropy(*one, d),
                "steady": lambda: compressed_entropy(*one, d, old_grams=grams_one),
                "qr": lambda: compressed_entropy(*one, d, "qr")}
    layer_fns = {"cold": lambda: compressed_entropy(*layer, d),
                 "steady": lambda: compressed_entropy(*layer, d, old_grams=grams_layer),
                 "qr": lambda: compressed_entropy(*layer, d, "qr")}
    if groups:  # the same query heads, one key block per group of heads // groups consecutive heads
        gq = [t.unflatten(0, (groups, heads // groups)) for t in (wq, wq_new)]
        gk = [t.unflatten(0, (groups, heads // groups))[:, :1] for t in (wk, wk_new)]
        gqa = (gq[0], gk[0], gq[1], gk[1])
        grams_gqa = snapshot_grams(*gqa[:2])
        layer_fns["gqa cold"] = lambda: compressed_entropy(*gqa, d)
        layer_fns["gqa steady"] = lambda: compressed_entropy(*gqa, d, old_grams=grams_gqa)
    # every function at every thread count, in turn: {(name, n): (result, wall, cpu)}
    t_head = round_robin({(k, n): at_threads(n, fn) for k, fn in head_fns.items() for n in counts}, device,
                         args.repeats)
    t_layer = round_robin({(k, n): at_threads(n, fn) for k, fn in layer_fns.items() for n in counts}, device,
                          layer_repeats)
    (sv_one, ent_one), (sv_qr, _) = t_head[("cold", 1)][0], t_head[("qr", 1)][0]
    (sv_layer, ent_layer), (sv_steady, _) = t_layer[("cold", 1)][0], t_layer[("steady", 1)][0]
    sv_layer_all = t_layer[("cold", counts[-1])][0][0]

    dense_times = {n: [] for n in counts}
    dense_errors, comp_abs, comp_rel, qr_rel, dense_rel, dense_ent_err, comp_ent_err, steady_rel = ([] for _ in range(8))
    for i in range(dense_heads):
        blocks = [t[i] for t in layer]
        for n in counts:  # one run each, alternating thread counts
            sv_dense, t_dense, cpu_dense = timed(at_threads(n, lambda: dense_spectrum(*blocks, args.dense_method)),
                                                 device)
            dense_times[n].append((t_dense, cpu_dense))
        ref = torch.linalg.svdvals(dense_delta2(*[b.double() for b in blocks]))
        ent_ref = spectral_stats(ref[: 2 * h], matrix_dim=d)["entropy"].item()
        ent_dense = spectral_stats(sv_dense, matrix_dim=d)["entropy"].item()
        dense_errors.append(spectrum_error(sv_dense[: 2 * h], ref))
        dense_rel.append(relative_spectrum_error(sv_dense[: 2 * h], ref, d))
        comp_abs.append(spectrum_error(sv_layer[i], ref))
        comp_rel.append(relative_spectrum_error(sv_layer[i], ref, d))
        steady_rel.append(relative_spectrum_error(sv_steady[i], ref, d))
        if i == 0:
            qr_rel.append(relative_spectrum_error(sv_qr, ref, d))
        dense_ent_err.append(abs(ent_dense - ent_ref) / ent_ref)
        comp_ent_err.append(abs(ent_layer[i].item() - ent_ref) / ent_ref)
    dense_head = {n: (min(t for t, _ in v), min(c for _, c in v)) for n, v in dense_times.items()}

    sv64 = qk_increment_singular_values(*[t.double() for t in layer], method="qr")
    layer_core_err = relative_spectrum_error(sv_layer, sv64, d)
    extrapolated = f"EXTRAPOLATED: {dense_heads} heads timed × {heads}/{dense_heads}" if dense_heads < heads else "timed"

    rows = []
    for n in counts:
        rows += [(n, "1 head", name, *t_head[(key, n)][1:], f"best of {args.repeats}") for key, name in
                 (("cold", "Gram core, cold"), ("steady", "Gram core, steady"), ("qr", "thin-QR core (before)"))]
        rows.append((n, "1 head", f"dense {args.dense_method}", *dense_head[n], f"best of {dense_heads} heads, 1 run each"))
        rows += [(n, f"{heads}-head layer", name, *t_layer[(key, n)][1:], f"best of {layer_repeats}")
                 for key, name in (("cold", "Gram core, cold"), ("steady", "Gram core, steady"),
                                   ("qr", "thin-QR core (before)"))]
        rows.append((n, f"{heads}-head layer", f"dense {args.dense_method}", dense_head[n][0] * heads,
                     dense_head[n][1] * heads, extrapolated))
        if groups:
            rows += [(n, f"{heads}h/{groups}kv GQA", f"Gram core, {key[4:]}", *t_layer[(key, n)][1:],
                      f"best of {layer_repeats}") for key in ("gqa cold", "gqa steady")]
    print()
    print(f"{'threads':>7} {'case':<16} {'method':<24} {'wall [s]':>10} {'CPU [s]':>10}  note")
    for n, case, method, seconds, cpu, note in rows:
        print(f"{n:>7} {case:<16} {method:<24} {seconds:>10.4f} {cpu:>10.4f}  {note}")
    max_rel = max(comp_rel)
    max_ent = max(comp_ent_err)
    print()
    if args.quick:
        print("(--quick: small sizes; the targets below are meant for d=4096, h=128)")

    def verdict(ratio):
        """The ratio against the target."""
        return f"{ratio:8.1f}x  {'PASS' if ratio >= TARGET_RATIO else 'FAIL'} (target >= {TARGET_RATIO:.0f}x)"

    cases = [("1 head", t_head, 1, ""), (f"{heads}-head layer", t_layer, heads, "")]
    if groups:
        cases.append((f"{heads}-head GQA ({groups} KV)", t_layer, heads, "gqa "))
    print("speed ratio = dense / Gram core at the same thread count, wall clock (CPU time of this process in brackets):")
    for n in counts:
        t_dense, cpu_dense = dense_head[n]
        for case, times, m, prefix in cases:
            cold, steady = times[(prefix + "cold", n)], times[(prefix + "steady", n)]
            print(f"  {n} thread(s) {case:<22} cold {verdict(t_dense * m / cold[1])} [{cpu_dense * m / cold[2]:.0f}x]   "
                  f"steady {verdict(t_dense * m / steady[1])} [{cpu_dense * m / steady[2]:.0f}x]")
        print(f"  {n} thread(s) thin-QR core (before): 1 head {t_dense / t_head[('qr', n)][1]:.1f}x, "
              f"layer {t_dense * heads / t_layer[('qr', n)][1]:.1f}x")
    if len(counts) > 1:
        top = counts[-1]
        print(f"core time at {top} threads vs 1 thread, wall (target: all cores <= 1 thread):")
        for case, times, _, prefix in cases:
            for kind in ("cold", "steady"):
                one_t, all_t = times[(prefix + kind, 1)][1], times[(prefix + kind, top)][1]
                print(f"  {case:<22} {kind:<6} {one_t * 1e3:9.2f} ms -> {all_t * 1e3:9.2f} ms "
                      f"({all_t / one_t:.2f}x)  {'PASS' if all_t <= one_t else 'FAIL'}")
        print(f"  dense {args.dense_method} per head: {dense_head[1][0]:.3f} s -> {dense_head[top][0]:.3f} s")
    print(f"spectrum rel. error vs float64 dense SVD ({dense_heads} heads), max |Δσ_i|/σ_i above the rank tolerance:")
    print(f"  Gram core fp32, cold: {max_rel:.2e}  entropy {max_ent:.2e}  (target <= {TARGET_ERROR:.0e}) "
          f"{'PASS' if max(max_rel, max_ent) <= TARGET_ERROR else 'FAIL'}")
    print(f"  Gram core fp32, steady: {max(steady_rel):.2e}  (target <= {TARGET_ERROR:.0e}) "
          f"{'PASS' if max(steady_rel) <= TARGET_ERROR else 'FAIL'}")
    print(f"  thin-QR fp32:   {max(qr_rel):.2e} (head 0);  dense fp32: {max(dense_rel):.2e}  "
          f"entropy {max(dense_ent_err):.2e}")
    print(f"  max |Δσ|/σ_max: Gram {max(comp_abs):.2e}, dense {max(dense_errors):.2e}")
    print(f"all {heads} heads, Gram fp32 vs float64 thin-QR core: {layer_core_err:.2e}; "
          f"core at {counts[-1]} vs 1 thread(s): max |Δσ|/σ_max {spectrum_error(sv_layer_all, sv_layer):.1e}")
    if groups:
        expanded = qk_increment_singular_values(gqa[0], gqa[1].expand_as(gqa[0]), gqa[2], gqa[3].expand_as(gqa[2]))
        sv_gqa = t_layer[("gqa cold", 1)][0][0]
        print(f"GQA: shared key Gram vs one key copy per head, max |Δσ|/σ_max {spectrum_error(sv_gqa, expanded):.1e}")
    print(f"Δ2 entropy head 0: {ent_one.item():.6f} (single) {ent_layer[0].item():.6f} (batched); "
          f"max |single − batched| spectrum diff {spectrum_error(sv_one, sv_layer[0]):.1e}")
    gflops = {n: at_threads(n, lambda: gemm_throughput(d, h, max(1, GRAM_CHUNK_ELEMENTS // (d * h))))()
              for n in counts}
    print_bound(gflops, cases, counts, d, h, groups, dense_head, cpu_model())
    if args.profile:
        profile_head(*one, device, args.repeats, counts)
    print(f"load average at start {load_start[0]:.2f}, at end {os.getloadavg()[0]:.2f} "
          f"({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
