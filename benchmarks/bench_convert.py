"""Converter per-byte speed vs `cp -r`, workers' speed-up and peak RSS, on synthetic legacy / torch_dist checkpoints.

python benchmarks/bench_convert.py [--workdir D] [--size-gib 8] [--format legacy|torch_dist|both] [--workers 2]
                                   [--no-cold] [--vocab 4096]

Per format, two synthetic checkpoints (--size-gib and half of it; EP4, 32 SequentialMLP experts per MoE layer,
fp32, hidden 1024 / ffn 2048, scaled down below 1.5 GiB; word embeddings [--vocab, hidden] and an untied output
layer; Megatron's key names and args): legacy = `iter_*/mp_rank_00_{ep:03d}/model_optim_rng.pt` as Megatron-LM
writes it at TP1 EP4, torch_dist = megatron `dist_checkpointing.save` with one chunk per (layer, expert) and the
fc1 GLU halves as separate chunks. Each is converted to EP2=2, K=8 (75% of the experts pruned) in a child
process, timed against `cp -r` of the same folder:
- warm: the source read once before (page cache warm for both sides), at both sizes, with --workers W, and the
  large one again with --workers 1 (the workers' speed-up);
- cold: caches dropped (`sync; echo 3 > /proc/sys/vm/drop_caches`) before `cp -r` and before the conversion,
  where this process may (root); skipped with --no-cold.
The child reports its RSS after imports (baseline), its peak (VmHWM) and the largest peak of its worker
processes (getrusage RUSAGE_CHILDREN). Printed: one row per run, then per format the ratios against the issue's
targets (legacy <= 1.5x `cp -r`, torch_dist <= 2x on the large checkpoint; marginal s/GiB from the two sizes
<= 1.2x `cp`'s; workers 1 -> W >= 1.6x; peak RSS above the baseline <= 2x the largest tensor, per worker) and
a DeepSeek-V3-size estimate from the marginal cost and the RSS ratio. D is created if missing; everything
written under it is removed at the end.
"""
import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN, FFN, EXPERTS, EP = 1024, 2048, 32, 4
TARGET_EP, TARGET_K = 2, 8  # 75% pruning


def _args(layers: int, vocab: int, fmt: str):
    import argparse as ap

    return ap.Namespace(num_experts=EXPERTS, expert_model_parallel_size=EP, tensor_model_parallel_size=1,
                        pipeline_model_parallel_size=1, world_size=EP, data_parallel_size=EP, moe_router_topk=2,
                        moe_router_num_groups=None, moe_tp_extend_ep=False, num_layers=layers,
                        hidden_size=HIDDEN, ffn_hidden_size=FFN, padded_vocab_size=vocab,
                        untie_embeddings_and_output_weights=True, ckpt_format=fmt)


def write_legacy(root: str, layers: int, vocab: int) -> int:
    """Write the synthetic legacy checkpoint; return the largest tensor's bytes."""
    import torch

    gen = torch.Generator().manual_seed(0)
    n = EXPERTS // EP
    largest = 0
    for rank in range(EP):
        model = {"embedding.word_embeddings.weight": torch.randn(vocab, HIDDEN, generator=gen),
                 "decoder.final_layernorm.weight": torch.ones(HIDDEN),
                 "output_layer.weight": torch.randn(vocab, HIDDEN, generator=gen)}
        for i in range(layers):
            p = f"decoder.layers.{i}.mlp."
            model[p + "router.weight"] = torch.randn(EXPERTS, HIDDEN, generator=gen)
            for j in range(n):
                model[p + f"experts.local_experts.{j}.linear_fc1.weight"] = torch.randn(2 * FFN, HIDDEN, generator=gen)
                model[p + f"experts.local_experts.{j}.linear_fc2.weight"] = torch.randn(HIDDEN, FFN, generator=gen)
        largest = max(v.nbytes for v in model.values())
        folder = os.path.join(root, "iter_0000001", f"mp_rank_00_{rank:03d}")
        os.makedirs(folder)
        torch.save({"args": _args(layers, vocab, "torch"), "checkpoint_version": 3.0, "iteration": 1, "model": model,
                    "optimizer": {}, "rng_state": []}, os.path.join(folder, "model_optim_rng.pt"))
        del model
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("1")
    return largest


def write_dist(root: str, layers: int, vocab: int) -> int:
    """Write the synthetic torch_dist checkpoint with megatron dist_checkpointing.save; return the largest
    tensor's bytes."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from mindspeed_proxy import platform

    platform.activate("cpu")  # megatron's writer calls torch.cuda helpers
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    gen = torch.Generator().manual_seed(0)
    L, E, H, F = layers, EXPERTS, HIDDEN, FFN

    def st(key, data, shape, offset):
        return ShardedTensor(key=key, data=data, dtype=data.dtype, local_shape=tuple(data.shape),
                             global_shape=shape, global_offset=offset,
                             axis_fragmentations=tuple(g // s for g, s in zip(shape, data.shape)), replica_id=0)

    model = {"embedding.word_embeddings.weight": st("embedding.word_embeddings.weight",
                                                    torch.randn(vocab, H, generator=gen), (vocab, H), (0, 0)),
             "output_layer.weight": st("output_layer.weight", torch.randn(vocab, H, generator=gen), (vocab, H), (0, 0)),
             "decoder.final_layernorm.weight": st("decoder.final_layernorm.weight", torch.ones(H), (H,), (0,))}
    exp = "decoder.layers.mlp.experts.experts."
    for l in range(L):
        model[f"norm{l}"] = st("decoder.layers.pre_mlp_layernorm.weight", torch.ones(1, H), (L, H), (l, 0))
        model[f"router{l}"] = st("decoder.layers.mlp.router.weight", torch.randn(1, E, H, generator=gen), (L, E, H),
                                 (l, 0, 0))
        for e in range(E):
            for half in range(2):  # GLU: megatron shards fc1 as two chunks along its output rows
                model[f"fc1.{l}.{e}.{half}"] = st(exp + "linear_fc1.weight", torch.randn(1, 1, F, H, generator=gen),
                                                  (L, E, 2 * F, H), (l, e, half * F, 0))
            model[f"fc2.{l}.{e}"] = st(exp + "linear_fc2.weight", torch.randn(1, 1, H, F, generator=gen),
                                       (L, E, H, F), (l, e, 0, 0))
            for name in ("linear_fc1", "linear_fc2"):
                model[f"{name}.x.{l}.{e}"] = ShardedObject(exp + name + "._extra_state", None, (L, E), (l, e),
                                                           replica_id=0)
    state = {"args": _args(layers, vocab, "torch_dist"), "checkpoint_version": 3.0, "iteration": 1,
             "model": model, "num_floating_point_operations_so_far": 0}
    folder = os.path.join(root, "iter_0000001")
    os.makedirs(folder)
    dist_checkpointing.save(state, folder)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("1")
    dist.destroy_process_group()
    return max(vocab * H, 2 * F * H, E * H) * 4  # the largest parameter (stored in chunks of at most this)


def folder_bytes(root: str) -> int:
    """Total bytes of the files under `root`."""
    return sum(os.path.getsize(os.path.join(b, f)) for b, _, fs in os.walk(root) for f in fs)


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def child_convert(argv: list) -> None:
    """Run the converter in this process after its imports; print one JSON line of memory figures."""
    fmt = argv[0]
    import scipy.cluster.hierarchy  # noqa: F401  (imported by the clustering step)
    import torch  # noqa: F401

    import importlib

    import mindspeed_proxy.proxy.convert  # noqa: F401
    from mindspeed_proxy.proxy import cli

    # megatron.core.safe_globals: every format's reads allow megatron's own safe globals (importing megatron.core
    # pulls in torch.distributed.tensor, sympy, tensorboard: ~140 MiB, a fixed cost, not a per-tensor one)
    modules = ["megatron.core.safe_globals", "mindspeed_proxy.proxy.verify.legacy", "mindspeed_proxy.proxy.select.similarity",
               "mindspeed_proxy.proxy.io.hashing", "mindspeed_proxy.proxy.io.output_guard", "concurrent.futures.process", "multiprocessing"]
    if fmt == "torch_dist":
        modules += ["megatron.core.dist_checkpointing", "torch.distributed.checkpoint", "mindspeed_proxy.proxy.io.dist.reader",
                    "mindspeed_proxy.proxy.io.dist.chunks", "mindspeed_proxy.proxy.io.dist.writer"]
    try:  # as the command does first: megatron-core's fused functions stay eager (no torch._inductor import)
        from mindspeed_proxy.patches import eager_jit

        eager = eager_jit.apply()
    except ImportError:  # an older checkout without it (comparison runs)
        eager = contextlib.nullcontext()
    with eager:
        for name in modules:
            try:
                importlib.import_module(name)
            except ImportError:  # an older checkout without that module (comparison runs)
                pass
    baseline = _status()
    peaks = {"RssAnon": 0, "RssFile": 0, "RssShmem": 0}
    done = threading.Event()

    def sample():
        while not done.wait(0.01):
            s = _status()
            for k in peaks:
                peaks[k] = max(peaks[k], s.get(k, 0))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    code = cli.main(argv[1:])
    done.set()
    thread.join()
    end = _status()
    print("BENCH " + json.dumps({"rc": code, "baseline": baseline["VmRSS"], "hwm": end["VmHWM"],
                                 "worker_maxrss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                                 "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                                 "peak_anon": peaks["RssAnon"], "peak_file": peaks["RssFile"],
                                 "peak_shmem": peaks["RssShmem"], "baseline_anon": baseline["RssAnon"]}))


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def can_drop_caches() -> bool:
    """Whether this process may drop the page cache (root and a writable /proc/sys/vm/drop_caches)."""
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches() -> None:
    """sync, then drop the page cache, dentries and inodes."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3\n")


def warm(root: str) -> None:
    """Read every file under `root` once (page cache warm)."""
    for base, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(base, name), "rb", buffering=0) as fh:
                while fh.read(16 << 20):
                    pass


def _prepare(src: str, cold: bool) -> None:
    if cold:
        drop_caches()
    else:
        os.sync()
        warm(src)


def time_cp(src: str, work: str, cold: bool) -> float:
    """Seconds of `cp -r src` (its copy removed and synced after)."""
    copy = os.path.join(work, "copy")
    _prepare(src, cold)
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", src, copy], check=True)
    seconds = time.perf_counter() - t0
    shutil.rmtree(copy)
    os.sync()
    return seconds


def time_convert(fmt: str, src: str, work: str, largest: int, workers: int, cold: bool) -> dict:
    """One conversion of `src` in a child process; its seconds, CPU seconds and memory figures."""
    proxy = os.path.join(work, "proxy")
    _prepare(src, cold)
    load_before = _load()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    t0, c0 = time.perf_counter(), _child_cpu()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", fmt, "--load", src, "--save", proxy,
                           "--target-expert-parallel-size", str(TARGET_EP), "--target-num-experts", str(TARGET_K),
                           "--workers", str(workers)], capture_output=True, text=True, env=env)
    seconds, cpu = time.perf_counter() - t0, _child_cpu() - c0
    line = [x for x in proc.stdout.splitlines() if x.startswith("BENCH ")]
    if proc.returncode or not line:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
    out_size = folder_bytes(proxy)
    shutil.rmtree(proxy)
    os.sync()
    return dict(json.loads(line[0][6:]), seconds=seconds, cpu=cpu, out_size=out_size, largest=largest,
                workers=workers, cold=cold, load=f"{load_before} -> {_load()}")


def dims(size_gib: float, vocab: int, ref_gib: float) -> tuple:
    """(hidden, ffn, layers) giving a checkpoint of about `size_gib` GiB: the full shapes (one MoE layer =
    0.75 GiB) when the reference (large) size holds 8 such layers, else shapes scaled down (multiples of 64)
    so that it holds about 8; the layer count sets the size."""
    full = EXPERTS * 3 * FFN * HIDDEN * 4
    hidden = HIDDEN
    if ref_gib * 2 ** 30 < 8 * full:
        hidden = max(64, int(HIDDEN * (ref_gib * 2 ** 30 / (8 * full)) ** 0.5) // 64 * 64)
    ffn = hidden * FFN // HIDDEN
    per_layer, fixed = EXPERTS * 3 * ffn * hidden * 4, 2 * vocab * hidden * 4 * EP
    return hidden, ffn, max(1, round((size_gib * 2 ** 30 - fixed) / per_layer))


def make_checkpoint(fmt: str, root: str, size_gib: float, vocab: int, ref_gib: float) -> int:
    """Write the synthetic checkpoint in a child process; return its largest tensor's bytes."""
    hidden, ffn, layers = dims(size_gib, vocab, ref_gib)
    writer = "write_legacy" if fmt == "legacy" else "write_dist"
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); import bench_convert as b; "
            f"b.HIDDEN, b.FFN = {hidden}, {ffn}; print(b.{writer}({root!r}, {layers}, {vocab}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise SystemExit(proc.stderr[-4000:])
    return int(proc.stdout.strip().splitlines()[-1])


def row(fmt: str, size: int, cp_s: float, r: dict) -> str:
    """A markdown table row of one conversion."""
    mib, big = 2 ** 20, r["largest"]
    net, worker = r["hwm"] - r["baseline"], max(0, r["worker_maxrss"] - r["baseline"])
    return (f"| {fmt} {'cold' if r['cold'] else 'warm'} | {size / 2**30:.2f} GiB | {r['workers']} | {cp_s:.2f} s | "
            f"{r['seconds']:.2f} s | {r['seconds'] / cp_s:.2f}x | {r['cpu']:.1f} s | {big / mib:.1f} MiB | "
            f"{r['baseline'] / mib:.0f} MiB | {net / mib:.0f} MiB ({net / big:.2f}x) | "
            f"{worker / mib:.0f} MiB ({worker / big:.2f}x) | {r['load']} |")


HEADER = ("| run | size | workers | `cp -r` | convert | convert / cp | CPU s (convert) | largest tensor | "
          "baseline RSS | main peak - baseline | worker peak - baseline | load avg before -> after |\n|"
          + " --- |" * 12)
TARGETS = {"legacy": 1.5, "torch_dist": 2.0}
# DeepSeek-V3 (public config.json): 671B parameters in bf16, 256 routed experts, hidden 7168, vocab 129280
DSV3_BYTES, DSV3_LARGEST = 671e9 * 2, 129280 * 7168 * 2


def verdict(value: float, limit: float, at_most: bool = True) -> str:
    """'met' / 'NOT met' of value against limit."""
    return "met" if (value <= limit if at_most else value >= limit) else "NOT met"


def summary(fmt: str, res: dict, workers: int) -> list:
    """The ratios of one format against the targets, and the DeepSeek-V3 estimate."""
    big, small = res["big"], res["small"]
    lines = []
    for kind in ("warm", "cold"):
        if kind in big:
            r, cp_s = big[kind]
            ratio = r["seconds"] / cp_s
            lines.append(f"{fmt} {kind}: convert / cp -r = {r['seconds']:.2f} s / {cp_s:.2f} s = {ratio:.2f}x on "
                         f"{big['size'] / 2**30:.2f} GiB (target <= {TARGETS[fmt]}x: {verdict(ratio, TARGETS[fmt])})")
    (rb, cb), (rs, cs) = big["warm"], small["warm"]
    gib = max(big["size"] - small["size"], 1) / 2 ** 30
    conv_m, cp_m = (rb["seconds"] - rs["seconds"]) / gib, (cb - cs) / gib
    m_ratio = conv_m / cp_m if cp_m > 0 else float("inf")
    lines.append(f"{fmt} marginal s/GiB (warm, {small['size'] / 2**30:.2f} -> {big['size'] / 2**30:.2f} GiB): convert "
                 f"{conv_m:.3f}, cp {cp_m:.3f}, ratio {m_ratio:.2f}x (target <= 1.2x: {verdict(m_ratio, 1.2)})")
    one = big["workers1"]
    speedup = one["seconds"] / rb["seconds"]
    lines.append(f"{fmt} workers 1 -> {workers}: {one['seconds']:.2f} s -> {rb['seconds']:.2f} s = {speedup:.2f}x "
                 f"(target >= 1.6x: {verdict(speedup, 1.6, at_most=False)})")
    worst = max(max(r["hwm"], r["worker_maxrss"]) - r["baseline"] for r in (rb, one))
    rss = worst / rb["largest"]
    lines.append(f"{fmt} peak RSS above baseline, per process (main or worker): {worst / 2**20:.0f} MiB = {rss:.2f}x the "
                 f"largest tensor ({rb['largest'] / 2**20:.1f} MiB) (target <= 2x: {verdict(rss, 2.0)})")
    hours = max(conv_m, 0.0) * DSV3_BYTES / 2 ** 30 / 3600
    lines.append(f"{fmt} DeepSeek-V3 estimate (671B params bf16 = {DSV3_BYTES / 2**40:.2f} TiB, 256 experts -> 64): "
                 f"{hours:.2f} h at the measured marginal {conv_m:.3f} s/GiB with {workers} workers (cp -r: "
                 f"{max(cp_m, 0.0) * DSV3_BYTES / 2**30 / 3600:.2f} h); peak RSS per process ~ baseline "
                 f"{rb['baseline'] / 2**30:.2f} GiB + {rss:.2f} x the largest tensor (embedding 129280 x 7168 bf16, "
                 f"{DSV3_LARGEST / 2**30:.2f} GiB) = {(rb['baseline'] + rss * DSV3_LARGEST) / 2**30:.1f} GiB "
                 "(an estimate, scaled from this run)")
    return lines


def run_format(fmt: str, parent: str, a) -> dict:
    """Both checkpoints of `fmt`: write, measure, remove."""
    work = tempfile.mkdtemp(dir=parent, prefix=f"bench-convert-{fmt}-")
    res = {}
    try:
        for name, size in (("big", a.size_gib), ("small", a.size_gib / 2)):
            src = os.path.join(work, "src")
            largest = make_checkpoint(fmt, src, size, a.vocab, a.size_gib)
            entry = res[name] = {"size": folder_bytes(src)}
            kinds = ["warm"] + (["cold"] if name == "big" and a.cold else [])
            for kind in kinds:
                cp_s = time_cp(src, work, kind == "cold")
                r = time_convert(fmt, src, work, largest, a.workers, kind == "cold")
                entry[kind] = (r, cp_s)
                print(row(fmt, entry["size"], cp_s, r), flush=True)
            if name == "big":
                r = time_convert(fmt, src, work, largest, 1, False)
                entry["workers1"] = r
                print(row(fmt, entry["size"], entry["warm"][1], r), flush=True)
            shutil.rmtree(src)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res


def main() -> None:
    """Parse the flags, run the measurements, print the rows and the ratios against the targets."""
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_convert(sys.argv[2:])
        return
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", default=None, metavar="D", help="where the checkpoints go (created if missing)")
    p.add_argument("--size-gib", type=float, default=8.0, help="the large checkpoint's size (the small one: half)")
    p.add_argument("--format", choices=["legacy", "torch_dist", "both"], default="both")
    p.add_argument("--workers", type=int, default=2, help="--workers of the conversions (the speed-up: 1 -> this)")
    p.add_argument("--no-cold", dest="cold", action="store_false", help="skip the dropped-cache runs")
    p.add_argument("--vocab", type=int, default=4096, help="rows of the embedding / output layer")
    a = p.parse_args()
    if a.workers < 1 or a.size_gib <= 0:
        p.error("--workers must be >= 1 and --size-gib > 0")
    if a.workdir:
        os.makedirs(a.workdir, exist_ok=True)
    if a.cold and not can_drop_caches():
        print("cold runs: skipped (dropping the page cache needs root and a writable /proc/sys/vm/drop_caches)")
        a.cold = False
    formats = ["legacy", "torch_dist"] if a.format == "both" else [a.format]
    print(f"cores {os.cpu_count()}, load {_load()}, target EP{TARGET_EP} K={TARGET_K} of {EXPERTS} experts")
    print(HEADER, flush=True)
    results = {fmt: run_format(fmt, a.workdir, a) for fmt in formats}
    for fmt, res in results.items():
        print("\n".join(summary(fmt, res, a.workers)))


if __name__ == "__main__":
    main()
