"""Imported once by the launcher's fork server, so that each rank forks with torch and megatron-core loaded."""
import os
import warnings

os.environ["OMP_NUM_THREADS"] = "1"  # read by the OpenMP runtime when torch loads it, before any rank forks

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": each rank says it again
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import megatron.core  # noqa: F401
    from megatron.core import dist_checkpointing, parallel_state  # noqa: F401
    from megatron.core.models.gpt import GPTModel  # noqa: F401
    from megatron.core.optimizer import get_megatron_optimizer  # noqa: F401
    from megatron.core.distributed import DistributedDataParallel  # noqa: F401
    from megatron.core.transformer.moe import moe_layer  # noqa: F401
