"""Conversion wall time vs `cp -r` and peak RSS vs the largest tensor, on a synthetic legacy checkpoint.

python benchmarks/bench_convert.py [--gib 2.2] [--workdir DIR]
Writes a legacy Megatron-LM checkpoint (TP1, EP4, 32 SequentialMLP experts, fp32, Megatron's key names
and args fields) of about --gib GiB, then times `cp -r` of it and `convert_to_proxy.py` to EP2=2, K=16
(in a child process, peak RSS from getrusage), same run.
"""
import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_checkpoint(root: str, layers: int, experts: int = 32, ep: int = 4, hidden: int = 1024,
                     ffn: int = 2048) -> int:
    """Write the synthetic checkpoint; return the largest tensor's bytes."""
    args = argparse.Namespace(num_experts=experts, expert_model_parallel_size=ep, tensor_model_parallel_size=1,
                              pipeline_model_parallel_size=1, world_size=ep, data_parallel_size=ep,
                              moe_router_topk=2, moe_router_num_groups=None, moe_tp_extend_ep=False,
                              num_layers=layers, hidden_size=hidden, ckpt_format="torch")
    gen = torch.Generator().manual_seed(0)
    n = experts // ep
    largest = 0
    for rank in range(ep):
        model = {"embedding.word_embeddings.weight": torch.randn(4096, hidden, generator=gen)}
        for i in range(layers):
            p = f"decoder.layers.{i}.mlp."
            model[p + "router.weight"] = torch.randn(experts, hidden, generator=gen)
            for j in range(n):
                model[p + f"experts.local_experts.{j}.linear_fc1.weight"] = torch.randn(2 * ffn, hidden, generator=gen)
                model[p + f"experts.local_experts.{j}.linear_fc2.weight"] = torch.randn(hidden, ffn, generator=gen)
        largest = max(v.nbytes for v in model.values())
        folder = os.path.join(root, "iter_0000001", f"mp_rank_00_{rank:03d}")
        os.makedirs(folder)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model,
                    "optimizer": {}, "rng_state": []}, os.path.join(folder, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("1")
    return largest


def folder_bytes(root: str) -> int:
    """Total bytes of the files under `root`."""
    return sum(os.path.getsize(os.path.join(b, f)) for b, _, fs in os.walk(root) for f in fs)


def main() -> None:
    """Run the benchmark and print one table row."""
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=2.2)
    p.add_argument("--workdir", default=None)
    a = p.parse_args()
    work = tempfile.mkdtemp(dir=a.workdir, prefix="bench-convert-")
    try:
        per_layer = 32 * (2 * 2048 * 1024 + 1024 * 2048) * 4
        layers = max(1, round(a.gib * 2**30 / per_layer))
        src = os.path.join(work, "src")
        largest = write_checkpoint(src, layers)
        size = folder_bytes(src)
        t0 = time.perf_counter()
        subprocess.run(["cp", "-r", src, os.path.join(work, "copy")], check=True)
        cp_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.join(REPO, "convert_to_proxy.py"), "--load", src, "--save",
                               os.path.join(work, "proxy"), "--target-expert-parallel-size", "2",
                               "--target-num-experts", "16"], capture_output=True, text=True)
        conv_s = time.perf_counter() - t0
        if proc.returncode:
            raise SystemExit(proc.stderr)
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        print(f"| legacy | {size / 2**30:.2f} GiB | {cp_s:.1f} s | {conv_s:.1f} s | {conv_s / cp_s:.2f}x | "
              f"{peak / 2**20:.0f} MiB | {largest / 2**20:.0f} MiB | {peak / largest:.1f}x |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
