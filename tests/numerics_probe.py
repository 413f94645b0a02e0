"""Forward/backward of a real megatron-core MoE layer, with or without the transfer-to-CPU layer.

Run as `python numerics_probe.py {0|1} NUM_EXPERTS`; prints one JSON line with the output and gradient
checksums. Unpatched megatron-core cannot run its attention on a CPU-only torch (its global memory
buffer asks for a CUDA device), so the probe covers what both can run: the MoE layer (router,
allgather token dispatcher, SequentialMLP experts) and the dense MLP.
"""
import json
import os
import sys

import torch

torch.set_num_threads(1)
use_layer = sys.argv[1] == "1"
if use_layer:
    from mindspeed_proxy import platform

    platform.activate("cpu")
torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
from megatron.core import parallel_state as ps  # noqa: E402

ps.initialize_model_parallel(1, 1)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module  # noqa: E402

from mindspeed_proxy.tiny_moe import TinyMoEConfig, layer_spec, transformer_config  # noqa: E402

torch.manual_seed(0)
config = transformer_config(TinyMoEConfig(num_layers=1, num_experts=int(sys.argv[2])))
spec = layer_spec(config).layer_specs[0].submodules.mlp
extra = {"layer_number": 1} if config.num_moe_experts else {}
if isinstance(spec, ModuleSpec):
    mlp = build_module(spec, config=config, **extra)
else:  # megatron-core 0.19: a builder, called as TransformerLayer calls it, then numbered
    from megatron.core.process_groups_config import ProcessGroupCollection

    mlp = spec(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups(), is_mtp_layer=False,
               name=None)
    if hasattr(mlp, "set_layer_number"):
        mlp.set_layer_number(1)
x = torch.randn(16, 2, config.hidden_size, requires_grad=True)
out, _ = mlp(x)
out.float().square().mean().backward()
grads = {n: p.grad.double().sum().item() for n, p in mlp.named_parameters() if p.grad is not None}
print(json.dumps({"out": out.double().sum().item(), "out_sq": out.double().square().sum().item(),
                  "dx": x.grad.double().square().sum().item(), "grads": grads}))
