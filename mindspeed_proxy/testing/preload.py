"""Imported once by the launcher's fork server, so that each rank forks with torch and megatron-core loaded.

megatron-core is imported as the CPU platform makes it (feature eager-jit, patches/eager_jit.py): its
`jit_fuser` functions are decorated while `torch.compile` is eager, so no rank traces and builds them with
inductor on its first call; `torch.compile` itself is torch's again afterwards (nothing stays patched here).

The second group is what nearly every rank imported after it forked (listed from the suite's ranks): torch's
optimizers import torch._dynamo on their first construction, the monitor imports scipy.linalg, a rank unpickles
its test function (pytest), our trainer, monitor, platform layer and data (megatron-core's datasets), and the
layer specs (whose import builds megatron-core's MagicMock stand-ins for the Kitchen extension). Imported here,
once per fork server, they cost a rank nothing. Importing runs no code of ours beyond module level (no patch is
applied, no platform activated).
"""
import gc
import os
import warnings

os.environ["OMP_NUM_THREADS"] = "1"  # read by the OpenMP runtime when torch loads it, before any rank forks

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": each rank says it again
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from mindspeed_proxy.patches import eager_jit

    with eager_jit.apply():  # torch.compile is torch's again when the block ends
        import megatron.core  # noqa: F401
        from megatron.core import dist_checkpointing, parallel_state  # noqa: F401
        from megatron.core.models.gpt import GPTModel  # noqa: F401
        from megatron.core.optimizer import get_megatron_optimizer  # noqa: F401
        from megatron.core.distributed import DistributedDataParallel  # noqa: F401
        from megatron.core.transformer.moe import moe_layer  # noqa: F401
        from megatron.core.dist_checkpointing.strategies import torch as dist_torch_strategy  # noqa: F401
        from megatron.core.models.gpt import gpt_layer_specs  # noqa: F401

    import pytest  # noqa: F401
    import scipy.linalg  # noqa: F401
    import torch._dynamo  # noqa: F401

    import mindspeed_proxy.data  # noqa: F401
    import mindspeed_proxy.monitor  # noqa: F401
    import mindspeed_proxy.platform  # noqa: F401
    import mindspeed_proxy.training.loop  # noqa: F401

# Everything imported above lives as long as the server: out of the collector's reach, a rank's garbage
# collections never walk (and copy-on-write) the pages the server's objects share with it.
gc.freeze()
