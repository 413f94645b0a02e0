"""Save and load training checkpoints in Megatron-LM's two layouts.

- `torch` (legacy): `latest_checkpointed_iteration.txt` and
  `iter_{:07d}/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt` holding `args`,
  `checkpoint_version`, `iteration`, `model` (or `model{v}`), `optimizer`, `opt_param_scheduler`,
  `rng_state`, `num_floating_point_operations_so_far`; written by expert-data-parallel rank 0 of each
  (TP, PP, EP) coordinate, as Megatron-LM does (plus `distrib_optim.pt` with the distributed optimizer).
- `torch_dist`: `iter_{:07d}/` written through megatron-core `dist_checkpointing` (metadata.json,
  common.pt, .metadata, *.distcp), resharded on load.
"""
from __future__ import annotations

import os
import random

import numpy as np
import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0


def iteration_dir(root: str, iteration: int) -> str:
    """`root/iter_{iteration:07d}`."""
    return os.path.join(root, f"iter_{iteration:07d}")


def legacy_rank_dir(root: str, iteration: int, tp_rank: int, pp_rank: int, ep_rank: int,
                    pipeline_parallel: bool, expert_parallel: bool) -> str:
    """Megatron-LM's per-rank folder name `mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]`."""
    name = f"mp_rank_{tp_rank:02d}"
    if pipeline_parallel:
        name += f"_{pp_rank:03d}"
    if expert_parallel:
        name += f"_{ep_rank:03d}"
    return os.path.join(iteration_dir(root, iteration), name)


def read_tracker(root: str) -> int:
    """Iteration recorded in `root/latest_checkpointed_iteration.txt`; ValueError if absent or bad."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        raise ValueError(f"--load {root}: no {TRACKER} (not a Megatron checkpoint directory)")
    text = open(path, encoding="utf-8").read().strip()
    if not text.isdigit():
        raise ValueError(f"{path}: expected an iteration number, found {text!r}")
    return int(text)


def rng_state() -> dict:
    """Megatron-LM's per-rank RNG record (python, numpy, torch, accelerator, tracker states)."""
    from megatron.core import tensor_parallel

    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    """Restore a record made by `rng_state()`."""
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _model_key(index: int, count: int) -> str:
    return "model" if count == 1 else f"model{index}"


def _write_tracker(root: str, iteration: int) -> None:
    if torch.distributed.get_rank() == 0:
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))


def save_legacy(root: str, iteration: int, trainer, args) -> str:
    """Write Megatron-LM's legacy `torch` checkpoint of `trainer` at `iteration`; return this rank's dir."""
    from megatron.core import parallel_state as ps

    rank_dir = legacy_rank_dir(
        root, iteration, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size() > 1,
        ps.get_expert_model_parallel_world_size() > 1,
    )
    if trainer.cfg.use_distributed_optimizer:
        os.makedirs(rank_dir, exist_ok=True)
        trainer.optimizer.save_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))
    if ps.get_expert_data_parallel_rank() == 0:
        chunks = trainer.unwrapped()
        state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
        for i, chunk in enumerate(chunks):
            state[_model_key(i, len(chunks))] = chunk.state_dict_for_save_checkpoint()
        state["optimizer"] = trainer.optimizer.state_dict()
        state["opt_param_scheduler"] = trainer.scheduler.state_dict()
        state["rng_state"] = [rng_state()]
        state["num_floating_point_operations_so_far"] = 0
        os.makedirs(rank_dir, exist_ok=True)
        torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    torch.distributed.barrier()
    _write_tracker(root, iteration)
    torch.distributed.barrier()
    return rank_dir


def load_legacy(root: str, trainer, iteration: int | None = None) -> dict:
    """Load this rank's legacy checkpoint into `trainer`; return the checkpoint's non-tensor fields."""
    from megatron.core import parallel_state as ps

    iteration = read_tracker(root) if iteration is None else iteration
    rank_dir = legacy_rank_dir(
        root, iteration, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size() > 1,
        ps.get_expert_model_parallel_world_size() > 1,
    )
    path = os.path.join(rank_dir, "model_optim_rng.pt")
    if not os.path.isfile(path):
        raise ValueError(f"--load {root}: missing {path} for this rank's TP/PP/EP coordinate")
    state = safe_torch_load(path)
    chunks = trainer.unwrapped()
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state[_model_key(i, len(chunks))], strict=True)
    trainer.optimizer.load_state_dict(state["optimizer"])
    if trainer.cfg.use_distributed_optimizer:
        trainer.optimizer.load_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))
    trainer.scheduler.load_state_dict(state["opt_param_scheduler"])
    set_rng_state(state["rng_state"][0])
    return {"iteration": state["iteration"], "args": state["args"]}


def _sharding_metadata(trainer) -> dict:
    from megatron.core import parallel_state as ps

    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    if trainer.cfg.use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    return metadata


def _sharded_state(trainer, is_loading: bool) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    metadata = _sharding_metadata(trainer)
    chunks = trainer.unwrapped()
    state = {}
    for i, chunk in enumerate(chunks):
        state[_model_key(i, len(chunks))] = chunk.sharded_state_dict(metadata=metadata)
    state["optimizer"] = trainer.optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                              metadata=metadata)
    pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    dp, dp_rank = (ps.get_data_parallel_world_size(with_context_parallel=True),
                   ps.get_data_parallel_rank(with_context_parallel=True))
    state["rng_state"] = ShardedObject("rng_state", [rng_state()], (pp, tp, dp), (pp_rank, tp_rank, dp_rank),
                                       replica_id=0)
    return state


def save_dist(root: str, iteration: int, trainer, args) -> str:
    """Write a `torch_dist` checkpoint through megatron-core dist_checkpointing; return its folder."""
    from megatron.core import dist_checkpointing

    folder = iteration_dir(root, iteration)
    if torch.distributed.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    torch.distributed.barrier()
    state = _sharded_state(trainer, is_loading=False)
    state.update(args=args, checkpoint_version=CHECKPOINT_VERSION, iteration=iteration,
                 opt_param_scheduler=trainer.scheduler.state_dict(),
                 num_floating_point_operations_so_far=0)
    metadata = {k: v for k, v in _sharding_metadata(trainer).items() if k != "dp_cp_group"}
    dist_checkpointing.save(state, folder, content_metadata=metadata)
    torch.distributed.barrier()
    _write_tracker(root, iteration)
    torch.distributed.barrier()
    return folder


def load_dist(root: str, trainer, iteration: int | None = None) -> dict:
    """Load a `torch_dist` checkpoint into `trainer` (any TP/PP/EP it was saved with)."""
    from megatron.core import dist_checkpointing

    iteration = read_tracker(root) if iteration is None else iteration
    folder = iteration_dir(root, iteration)
    if not dist_checkpointing.check_is_distributed_checkpoint(folder):
        raise ValueError(f"--load {root}: {folder} is not a torch_dist checkpoint")
    common = dist_checkpointing.load_common_state_dict(folder)
    loaded = dist_checkpointing.load(_sharded_state(trainer, is_loading=True), folder)
    chunks = trainer.unwrapped()
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[_model_key(i, len(chunks))], strict=True)
    trainer.optimizer.load_state_dict(loaded["optimizer"])
    trainer.scheduler.load_state_dict(common["opt_param_scheduler"])
    rng = loaded["rng_state"]
    set_rng_state(rng[0] if isinstance(rng, list) else rng)
    return {"iteration": common["iteration"], "args": common["args"]}


def checkpoint_format(root: str, iteration: int | None = None) -> str:
    """'torch_dist' or 'torch' for the checkpoint under `root` (ValueError if neither)."""
    from megatron.core import dist_checkpointing

    iteration = read_tracker(root) if iteration is None else iteration
    folder = iteration_dir(root, iteration)
    if not os.path.isdir(folder):
        raise ValueError(f"--load {root}: tracker names iteration {iteration} but {folder} is missing")
    if dist_checkpointing.check_is_distributed_checkpoint(folder):
        return "torch_dist"
    if any(name.startswith("mp_rank_") for name in os.listdir(folder)):
        return "torch"
    raise ValueError(f"--load {root}: {folder} holds neither mp_rank_* folders nor a torch_dist checkpoint")
