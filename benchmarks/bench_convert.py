"""Conversion wall time vs `cp -r` and peak RSS vs the largest tensor, on synthetic legacy / torch_dist checkpoints.

python benchmarks/bench_convert.py [--format legacy|torch_dist|both] [--gib 2.2] [--vocab 4096] [--repeat 1]
                                   [--workdir DIR] [--before SRC_TREE]

Writes a checkpoint of about --gib GiB (EP4, 32 SequentialMLP experts of hidden 1024 / ffn 2048 per MoE
layer, fp32, word embeddings [--vocab, 1024] and an untied output layer of the same shape; Megatron's key
names and args fields): legacy = `iter_*/mp_rank_00_{ep:03d}/model_optim_rng.pt` as Megatron-LM writes
it at TP1 EP4, torch_dist = megatron `dist_checkpointing.save` of the global keys with one chunk per
(layer, expert) and the fc1 GLU halves as separate chunks, as megatron-core's SequentialMLP shards them.
Then, --repeat times: `cp -r` of it, and `convert_to_proxy.py` to EP2=2, K=16 in a child process that
reports its baseline RSS after imports, VmHWM, and sampled peaks of RssAnon / RssFile. One row per run,
then per format the ratios against the targets (conversion <= 2x `cp -r` for legacy, <= 3x for torch_dist;
peak RSS above the import baseline <= 2x the largest tensor). --before SRC_TREE (e.g. `git archive` of an
older commit unpacked) also converts with that tree's code right after each run, on the same checkpoint.
"""
import argparse
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

    modules = ["mindspeed_proxy.proxy.verify", "mindspeed_proxy.proxy.features"]
    if fmt == "torch_dist":
        modules += ["megatron.core.dist_checkpointing", "torch.distributed.checkpoint", "mindspeed_proxy.proxy.dist_io",
                    "mindspeed_proxy.proxy.dist_chunks", "mindspeed_proxy.proxy.dist_writer"]
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
                                 "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                                 "peak_anon": peaks["RssAnon"], "peak_file": peaks["RssFile"],
                                 "peak_shmem": peaks["RssShmem"], "baseline_anon": baseline["RssAnon"]}))


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_one(fmt: str, src: str, work: str, largest: int, code: str = REPO, cp: tuple = None) -> dict:
    """One `cp -r` (or the given `cp` = (seconds, CPU seconds)) and one conversion of `src` with the
    mindspeed_proxy of tree `code`; the row's figures."""
    copy, proxy = os.path.join(work, "copy"), os.path.join(work, "proxy")
    os.sync()
    load_before = _load()
    if cp is None:
        t0, c0 = time.perf_counter(), _child_cpu()
        subprocess.run(["cp", "-r", src, copy], check=True)
        cp = (time.perf_counter() - t0, _child_cpu() - c0)
        os.sync()
        shutil.rmtree(copy)
    cp_s, cp_cpu = cp
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([code] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    t0, c0 = time.perf_counter(), _child_cpu()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", fmt, "--load", src, "--save", proxy,
                           "--target-expert-parallel-size", "2", "--target-num-experts", "16"],
                          capture_output=True, text=True, env=env)
    conv_s, conv_cpu = time.perf_counter() - t0, _child_cpu() - c0
    line = [x for x in proc.stdout.splitlines() if x.startswith("BENCH ")]
    if proc.returncode or not line:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
    mem = json.loads(line[0][6:])
    out_size = folder_bytes(proxy)
    shutil.rmtree(proxy)
    return dict(mem, fmt=fmt if code == REPO else f"{fmt} (before)", size=folder_bytes(src), out_size=out_size,
                cp_s=cp_s, conv_s=conv_s, largest=largest, cp_cpu=cp_cpu, conv_cpu=conv_cpu,
                load=f"{load_before} -> {_load()}")


def row(r: dict) -> str:
    """A markdown table row of one run."""
    mib, big = 2 ** 20, r["largest"]
    net = r["hwm"] - r["baseline"]
    return (f"| {r['fmt']} | {r['size'] / 2**30:.2f} GiB | {big / mib:.0f} MiB | {r['cp_s']:.1f} s | "
            f"{r['conv_s']:.1f} s | {r['conv_s'] / r['cp_s']:.2f}x | {r['cp_cpu']:.1f} / {r['conv_cpu']:.1f} s | "
            f"{r['hwm'] / mib:.0f} MiB ({r['hwm'] / big:.1f}x) | "
            f"{r['baseline'] / mib:.0f} MiB | {net / mib:.0f} MiB ({net / big:.2f}x) | "
            f"{(r['peak_anon'] - r['baseline_anon']) / mib:.0f} / {r['peak_file'] / mib:.0f} MiB | {r['load']} |")


HEADER = ("| format | size | largest tensor | `cp -r` | convert | time ratio (<= 2x legacy, 3x torch_dist) | "
          "CPU s cp / convert | "
          "peak RSS (VmHWM) | "
          "baseline RSS after imports | peak - baseline (<= 2x) | peak anon above baseline / peak file-backed | "
          "load avg before -> after |\n|" + " --- |" * 12)


TIME_TARGET = {"legacy": 2.0, "torch_dist": 3.0}


def summary(fmt: str, rows: list) -> str:
    """The ratios of this tree's runs of `fmt` against the targets, one line."""
    times = [r["conv_s"] / r["cp_s"] for r in rows]
    cpu = [r["conv_cpu"] / max(r["cp_cpu"], 1e-3) for r in rows]
    mem = [(r["hwm"] - r["baseline"]) / r["largest"] for r in rows]
    verdict = lambda values, limit: "met" if max(values) <= limit else "NOT met"  # noqa: E731
    return (f"{fmt}: time ratio convert / cp -r {', '.join(f'{x:.2f}x' for x in times)} (target <= "
            f"{TIME_TARGET[fmt]:.0f}x: {verdict(times, TIME_TARGET[fmt])}); CPU-time ratio "
            f"{', '.join(f'{x:.2f}x' for x in cpu)}; peak RSS above baseline / largest tensor "
            f"{', '.join(f'{x:.2f}x' for x in mem)} (target <= 2x: {verdict(mem, 2.0)})")


def main() -> None:
    """Write the checkpoint(s), run the benchmark, print the table."""
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_convert(sys.argv[2:])
        return
    p = argparse.ArgumentParser()
    p.add_argument("--format", choices=["legacy", "torch_dist", "both"], default="both")
    p.add_argument("--gib", type=float, default=2.2, help="approximate checkpoint size (sets the MoE layer count)")
    p.add_argument("--vocab", type=int, default=4096, help="rows of the embedding / output layer (x 1024 fp32)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--workdir", default=None)
    p.add_argument("--before", default=None, metavar="SRC_TREE",
                   help="also convert with the mindspeed_proxy of this source tree after each run (comparison)")
    a = p.parse_args()
    formats = ["legacy", "torch_dist"] if a.format == "both" else [a.format]
    print(HEADER, flush=True)
    runs: dict = {}
    for fmt in formats:
        work = tempfile.mkdtemp(dir=a.workdir, prefix="bench-convert-")
        try:
            per_layer = EXPERTS * (3 * FFN * HIDDEN) * 4
            fixed = 2 * a.vocab * HIDDEN * 4 * (EP if fmt == "legacy" else 1)
            layers = max(1, round((a.gib * 2 ** 30 - fixed) / per_layer))
            src = os.path.join(work, "src")
            writer = write_legacy if fmt == "legacy" else write_dist
            proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
                                   f"import bench_convert as b; print(b.{writer.__name__}({src!r}, {layers}, {a.vocab}))"],
                                  capture_output=True, text=True, cwd=REPO)
            if proc.returncode:
                raise SystemExit(proc.stderr[-4000:])
            largest = int(proc.stdout.strip().splitlines()[-1])
            for _ in range(a.repeat):
                runs.setdefault(fmt, []).append(run_one(fmt, src, work, largest))
                print(row(runs[fmt][-1]), flush=True)
                if a.before:
                    cp = (runs[fmt][-1]["cp_s"], runs[fmt][-1]["cp_cpu"])
                    print(row(run_one(fmt, src, work, largest, os.path.abspath(a.before), cp)), flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    for fmt, rows in runs.items():
        print(summary(fmt, rows))


if __name__ == "__main__":
    main()
