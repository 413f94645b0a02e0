"""Train a tiny megatron-core GPT-MoE with Megatron-LM flags.

    torchrun --nproc-per-node 2 examples/train_moe.py --expert-model-parallel-size 2 --train-iters 100

Runs on CPU (gloo) through mindspeed_proxy.platform, or on CUDA / NPU when present.
"""
import sys

from mindspeed_proxy.training.loop import train

if __name__ == "__main__":  # dist_checkpointing spawns helper processes: keep work under main
    sys.exit(train(sys.argv[1:], prog="train_moe.py"))
