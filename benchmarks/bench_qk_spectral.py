"""Δ2 spectrum: compressed 2h×2h core (Gram, and the former thin-QR core) vs dense SVD of the formed d×d Δ2.

    python benchmarks/bench_qk_spectral.py [--device cpu|cuda] [--quick] [--threads N]

All paths run on the same fp32 inputs in the same process. The reference is a float64 dense SVD of
Δ2 formed in float64 from those inputs. The dense 32-head layer time is extrapolated linearly from
`--dense-heads` timed heads (printed as such). Times are best-of-N wall clock (the machine may be
shared; the load average is printed). The layer is MHA (one key block per head); the GQA row times the
same 32 query heads with `--kv-groups` shared key blocks, whose Gram the core computes once per group.

Spectrum relative error (the accuracy target) = max_i |σ_i − σ_ref,i| / σ_ref,i over the reference
values above the rank tolerance that `spectral_stats` applies to fp32 spectra (σ > max(2h, d)·eps_fp32·σ_max),
over the timed dense heads; the relative error of the spectral entropy H (α = 2) is reported beside it,
and so is max_i |σ_i − σ_ref,i| / σ_ref,max over all 2h values.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from mindspeed_proxy.monitor.spectral import qk_increment_singular_values, spectral_stats

TARGET_RATIO = 1000.0
TARGET_ERROR = 1e-4


def sync(device: torch.device) -> None:
    """Wait for queued device work (CUDA) so that wall-clock timings cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats=1, warmup=0):
    """Return (result, best seconds over `repeats` runs after `warmup` untimed runs)."""
    for _ in range(warmup):
        fn()
    times, result = [], None
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return result, min(times)


def dense_delta2(wq, wk, wq_new, wk_new):
    """The formed d×d Δ2 = ΔWq Wkᵀ + Wq ΔWkᵀ."""
    return (wq_new - wq) @ wk.mT + wq @ (wk_new - wk).mT


def dense_spectrum(wq, wk, wq_new, wk_new, method):
    """Singular values of the formed Δ2 by dense SVD (or eigh of its d×d Gram)."""
    delta = dense_delta2(wq, wk, wq_new, wk_new)
    if method == "svd":
        return torch.linalg.svdvals(delta)
    return torch.linalg.eigvalsh(delta.mT @ delta).clamp_min(0).sqrt().flip(-1)


def compressed_entropy(wq, wk, wq_new, wk_new, d, method="gram"):
    """Δ2 singular values by the compressed core (`method`) and their spectral entropy."""
    sv = qk_increment_singular_values(wq, wk, wq_new, wk_new, term="delta2", method=method)
    return sv, spectral_stats(sv, matrix_dim=d)["entropy"]


def spectrum_error(sv, ref):
    """max_i |σ_i − σ_ref,i| / σ_ref,max over the leading len(sv) values."""
    ref = ref[..., : sv.shape[-1]].double()
    return ((sv.double() - ref).abs().amax(-1) / ref[..., 0]).max().item()


def relative_spectrum_error(sv, ref, d):
    """max_i |σ_i − σ_ref,i| / σ_ref,i over the reference values above the fp32 rank tolerance."""
    ref = ref[..., : sv.shape[-1]].double()
    keep = ref > max(ref.shape[-1], d) * torch.finfo(torch.float32).eps * ref[..., :1]
    return ((sv.double() - ref).abs() / ref.clamp_min(1e-300))[keep].max().item()


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
    """Run the benchmark and print the table, ratios and errors."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="d=1024, h=64, 8 heads, 1 dense head")
    parser.add_argument("--d", type=int, default=None)
    parser.add_argument("--h", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--dense-heads", type=int, default=None, help="heads timed densely (rest extrapolated)")
    parser.add_argument("--dense-method", default="svd", choices=["svd", "gram-eigh"])
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (1 avoids OpenMP stalls on a shared, oversubscribed machine)")
    parser.add_argument("--repeats", type=int, default=7, help="repeats of the compressed timings (best of)")
    parser.add_argument("--kv-groups", type=int, default=None, help="KV groups of the GQA row (default heads/4; 0: skip)")
    args = parser.parse_args(argv)

    d = args.d or (1024 if args.quick else 4096)
    h = args.h or (64 if args.quick else 128)
    heads = args.heads or (8 if args.quick else 32)
    dense_heads = min(args.dense_heads or (1 if args.quick else 2), heads)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested but CUDA is not available")
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} "
          f"d={d} h={h} heads={heads} dtype=float32 dense={args.dense_method}")

    load_start = os.getloadavg()
    wq, wk, wq_new, wk_new = make_layer(heads, d, h, device)
    one = [t[0] for t in (wq, wk, wq_new, wk_new)]
    layer = (wq, wk, wq_new, wk_new)
    layer_repeats = max(1, args.repeats // 2)

    (sv_one, ent_one), t_comp_head = timed(lambda: compressed_entropy(*one, d), device, args.repeats, warmup=1)
    (sv_layer, ent_layer), t_comp_layer = timed(lambda: compressed_entropy(*layer, d), device, layer_repeats, warmup=1)
    (sv_qr, _), t_qr_head = timed(lambda: compressed_entropy(*one, d, "qr"), device, args.repeats, warmup=1)
    _, t_qr_layer = timed(lambda: compressed_entropy(*layer, d, "qr"), device, layer_repeats, warmup=1)
    groups = heads // 4 if args.kv_groups is None else args.kv_groups
    groups = groups if 0 < groups < heads and heads % groups == 0 else 0
    if groups:  # the same query heads, one key block per group of heads // groups consecutive heads
        gq = [t.unflatten(0, (groups, heads // groups)) for t in (wq, wq_new)]
        gk = [t.unflatten(0, (groups, heads // groups))[:, :1] for t in (wk, wk_new)]
        gqa = (gq[0], gk[0], gq[1], gk[1])
        (sv_gqa, _), t_comp_gqa = timed(lambda: compressed_entropy(*gqa, d), device, layer_repeats, warmup=1)

    dense_times, dense_errors, comp_abs, comp_rel, qr_rel, dense_rel, dense_ent_err, comp_ent_err = ([] for _ in range(8))
    for i in range(dense_heads):
        blocks = [t[i] for t in layer]
        sv_dense, t_dense = timed(lambda: dense_spectrum(*blocks, args.dense_method), device)
        dense_times.append(t_dense)
        ref = torch.linalg.svdvals(dense_delta2(*[b.double() for b in blocks]))
        ent_ref = spectral_stats(ref[: 2 * h], matrix_dim=d)["entropy"].item()
        ent_dense = spectral_stats(sv_dense, matrix_dim=d)["entropy"].item()
        dense_errors.append(spectrum_error(sv_dense[: 2 * h], ref))
        dense_rel.append(relative_spectrum_error(sv_dense[: 2 * h], ref, d))
        comp_abs.append(spectrum_error(sv_layer[i], ref))
        comp_rel.append(relative_spectrum_error(sv_layer[i], ref, d))
        if i == 0:
            qr_rel.append(relative_spectrum_error(sv_qr, ref, d))
        dense_ent_err.append(abs(ent_dense - ent_ref) / ent_ref)
        comp_ent_err.append(abs(ent_layer[i].item() - ent_ref) / ent_ref)
    t_dense_head = min(dense_times)
    t_dense_layer = t_dense_head * heads

    sv64 = qk_increment_singular_values(*[t.double() for t in layer], method="qr")
    layer_core_err = relative_spectrum_error(sv_layer, sv64, d)
    extrapolated = f"EXTRAPOLATED: {dense_heads} heads timed × {heads}/{dense_heads}" if dense_heads < heads else "timed"

    rows = [
        ("1 head", "Gram core", t_comp_head, f"best of {args.repeats}"),
        ("1 head", "thin-QR core (before)", t_qr_head, f"best of {args.repeats}"),
        ("1 head", f"dense {args.dense_method}", t_dense_head, f"best of {dense_heads} heads, 1 run each"),
        (f"{heads}-head layer", "Gram core (batched)", t_comp_layer, f"best of {layer_repeats}"),
        (f"{heads}-head layer", "thin-QR core (before)", t_qr_layer, f"best of {layer_repeats}"),
        (f"{heads}-head layer", f"dense {args.dense_method}", t_dense_layer, extrapolated),
    ]
    if groups:
        rows.append((f"{heads}h/{groups}kv GQA", "Gram core (key Gram/group)", t_comp_gqa, f"best of {layer_repeats}"))
    print()
    print(f"{'case':<16} {'method':<28} {'time [s]':>10}  note")
    for case, method, seconds, note in rows:
        print(f"{case:<16} {method:<28} {seconds:>10.4f}  {note}")
    ratio_head = t_dense_head / t_comp_head
    ratio_layer = t_dense_layer / t_comp_layer
    max_rel = max(comp_rel)
    max_ent = max(comp_ent_err)
    print()
    if args.quick:
        print("(--quick: small sizes; the targets below are meant for d=4096, h=128)")
    print(f"speed ratio, 1 head:       {ratio_head:10.1f}x  (target >= {TARGET_RATIO:.0f}x) "
          f"{'PASS' if ratio_head >= TARGET_RATIO else 'FAIL'}   thin-QR core: {t_dense_head / t_qr_head:.1f}x")
    print(f"speed ratio, {heads}-head layer: {ratio_layer:7.1f}x  (target >= {TARGET_RATIO:.0f}x) "
          f"{'PASS' if ratio_layer >= TARGET_RATIO else 'FAIL'}   thin-QR core: {t_dense_layer / t_qr_layer:.1f}x")
    if groups:
        print(f"speed ratio, {heads}-head GQA layer ({groups} KV groups): {t_dense_layer / t_comp_gqa:.1f}x "
              f"(dense per head as above)")
    print(f"spectrum rel. error vs float64 dense SVD ({dense_heads} heads), max |Δσ_i|/σ_i above the rank tolerance:")
    print(f"  Gram core fp32: {max_rel:.2e}  entropy {max_ent:.2e}  (target <= {TARGET_ERROR:.0e}) "
          f"{'PASS' if max(max_rel, max_ent) <= TARGET_ERROR else 'FAIL'}")
    print(f"  thin-QR fp32:   {max(qr_rel):.2e} (head 0);  dense fp32: {max(dense_rel):.2e}  "
          f"entropy {max(dense_ent_err):.2e}")
    print(f"  max |Δσ|/σ_max: Gram {max(comp_abs):.2e}, dense {max(dense_errors):.2e}")
    print(f"all {heads} heads, Gram fp32 vs float64 thin-QR core: {layer_core_err:.2e}")
    if groups:
        expanded = qk_increment_singular_values(gqa[0], gqa[1].expand_as(gqa[0]), gqa[2], gqa[3].expand_as(gqa[2]))
        print(f"GQA: shared key Gram vs one key copy per head, max |Δσ|/σ_max {spectrum_error(sv_gqa, expanded):.1e}")
    print(f"Δ2 entropy head 0: {ent_one.item():.6f} (single) {ent_layer[0].item():.6f} (batched); "
          f"max |single − batched| spectrum diff {spectrum_error(sv_one, sv_layer[0]):.1e}")
    print(f"load average at start {load_start[0]:.2f}, at end {os.getloadavg()[0]:.2f} "
          f"({os.cpu_count()} CPUs)")

if __name__ == "__main__":
    main()
