"""DeepSpeed as a host of the mechanism monitor: `attach_monitor(engine, config)` on a Hugging Face MoE model.

```python
skip_shm_comm_build()                                   # on CPU, before init_distributed: nothing to compile
deepspeed.init_distributed(dist_backend="gloo")
engine, *_ = deepspeed.initialize(model=model, config="ds_config.json", model_parameters=model.parameters())
monitor = attach_monitor(engine, "ds_config.json")     # reads its "mechanism_monitor": {...} block
for batch in data:
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    monitor.step()                                      # after every engine.step(), on every rank
monitor.close()
```

Nothing of DeepSpeed is patched: router logits come from forward hooks on the gate modules
(`register_forward_hook`), the step count from `engine.global_steps`, ZeRO-3 parameters are gathered with
`deepspeed.zero.GatheredParameters` one decoder layer at a time, and the data-parallel group is the engine's
(DeepSpeed-MoE layers: their own expert-parallel group, hf_targets.py). `skip_shm_comm_build` replaces
DeepSpeed's CPU accelerator through its public `set_accelerator`, not a patch.
"""
from __future__ import annotations

import contextlib
import json
import os


import torch.distributed as dist

from mindspeed_proxy.extras import require
from mindspeed_proxy.hosts.hf_monitor import HFMonitor, dp_groups
from mindspeed_proxy.monitor.config import MonitorConfig

BLOCK = "mechanism_monitor"


def monitor_config(config) -> MonitorConfig:
    """The MonitorConfig of `config`: a MonitorConfig, a DeepSpeed config (dict or JSON file) holding a
    "mechanism_monitor" block, or the monitor's own mapping / JSON / YAML file. ValueError naming what is wrong."""
    if isinstance(config, MonitorConfig):
        return config
    where = "DeepSpeed config"
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if path.endswith((".yaml", ".yml")):
            return MonitorConfig.from_file(path)
        where = path
        try:
            with open(path, encoding="utf-8") as fh:
                config = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot read the config ({type(exc).__name__}: {exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(config).__name__}")
    block = config.get(BLOCK, config if "train_batch_size" not in config and
                       "train_micro_batch_size_per_gpu" not in config else None)
    if not isinstance(block, dict):
        raise ValueError(f"{where}: no \"{BLOCK}\" block (a mapping of monitor settings)")
    try:
        return MonitorConfig.from_dict(block)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: \"{BLOCK}\": {exc}") from None


def skip_shm_comm_build() -> bool:
    """Make DeepSpeed's CPU accelerator decline only its shared-memory comm op, so that
    `deepspeed.init_distributed(dist_backend="gloo")` compiles nothing (collectives go through gloo).

    Call before `init_distributed` in every process; True when installed, False when the accelerator in use
    is not DeepSpeed's CPU one (a GPU or NPU keeps its own)."""
    require("deepspeed", "mindspeed_proxy.hosts.deepspeed")
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    current = get_accelerator()
    if type(current) is not CPU_Accelerator:
        return type(current).__name__ == "NoShmCPUAccelerator"

    class NoShmCPUAccelerator(CPU_Accelerator):
        """DeepSpeed's CPU accelerator without the ShareMemCommBuilder op (a JIT-compiled C++ extension)."""

        def create_op_builder(self, op_name):
            return None if op_name == "ShareMemCommBuilder" else super().create_op_builder(op_name)

        def get_op_builder(self, class_name):
            return None if class_name == "ShareMemCommBuilder" else super().get_op_builder(class_name)

    set_accelerator(NoShmCPUAccelerator())
    return True


def zero3_gather(params):
    """Gather the ZeRO-3-partitioned ones among `params` for the block (every rank must enter); read-only."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)


def engine_writers(engine) -> tuple:
    """(TensorBoard SummaryWriter, wandb logger) of the engine's own monitor (the `"tensorboard"` / `"wandb"` blocks
    of the DeepSpeed config; DeepSpeed creates them on rank 0), None where it has none."""
    master = getattr(engine, "monitor", None)
    tensorboard = getattr(getattr(master, "tb_monitor", None), "summary_writer", None)
    wandb = getattr(master, "wandb_monitor", None)  # its log(data, step) writes on rank 0
    return tensorboard, wandb


class DeepSpeedMonitor(HFMonitor):
    """HFMonitor driven by a DeepSpeed engine: call `step()` after every `engine.step()` on every rank."""

    def __init__(self, engine, config, tensorboard_writer=None, wandb_writer=None):
        self.engine = engine
        group = getattr(engine, "data_parallel_group", None)
        own_tensorboard, own_wandb = engine_writers(engine)
        tensorboard_writer = tensorboard_writer if tensorboard_writer is not None else own_tensorboard
        wandb_writer = wandb_writer if wandb_writer is not None else own_wandb
        super().__init__(monitor_config(config), engine.module, groups=dp_groups(group), gather=zero3_gather,
                         tensorboard_writer=tensorboard_writer, wandb_writer=wandb_writer,
                         iteration=engine.global_steps)
        self._seen_step = engine.global_steps

    def step(self) -> None:
        """Run what is due if the engine finished an optimizer step since the last call (gradient
        accumulation: engine.step() steps only at the boundary; a call without a new step does nothing)."""
        iteration = self.engine.global_steps
        if iteration == self._seen_step:
            return
        self._seen_step = iteration
        self.after_optimizer_step(iteration)


def attach_monitor(engine, config, tensorboard_writer=None, wandb_writer=None) -> DeepSpeedMonitor:
    """Attach the mechanism monitor to a DeepSpeed engine wrapping a transformers MoE model (every rank); its
    scalars go to the engine's own TensorBoard / wandb writers unless others are given (or `sinks` omits them)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("attach_monitor: torch.distributed is not initialised (call deepspeed.initialize first)")
    return DeepSpeedMonitor(engine, config, tensorboard_writer, wandb_writer)


