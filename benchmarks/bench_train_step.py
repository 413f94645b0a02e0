"""Per-step time of the tiny MoE trainer on 1 rank (EP=1) and 2 ranks (EP=2), same global batch.

    python benchmarks/bench_train_step.py [--iters 40]

Prints the median step time of each layout (first 5 steps excluded) and the 2-rank / 1-rank ratio.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def median_step_ms(nproc: int, ep: int, iters: int, extra: list[str]) -> float:
    """Run the trainer under torchrun and return its median step time in ms."""
    with tempfile.TemporaryDirectory() as log_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               str(REPO / "examples" / "train_moe.py"), "--expert-model-parallel-size", str(ep),
               "--train-iters", str(iters), "--log-interval", str(iters), "--log-dir", log_dir, *extra]
        subprocess.run(cmd, check=True, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))})
        records = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))][1:]
    return 1000 * statistics.median(r["step_time_s"] for r in records[5:])


def main() -> None:
    """Run both layouts and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=40)
    args, extra = parser.parse_known_args()
    one = median_step_ms(1, 1, args.iters, extra)
    two = median_step_ms(2, 2, args.iters, extra)
    print(f"{'layout':<24}{'median step (ms)':>18}")
    print(f"{'1 rank, EP=1':<24}{one:>18.1f}")
    print(f"{'2 ranks, EP=2':<24}{two:>18.1f}")
    print(f"ratio 2-rank / 1-rank: {two / one:.2f}")


if __name__ == "__main__":
    main()
