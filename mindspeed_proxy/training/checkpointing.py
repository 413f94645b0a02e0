"""Save and load training checkpoints in Megatron-LM's two layouts.

- `torch` (legacy): `latest_checkpointed_iteration.txt` and
  `iter_{:07d}/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt` holding `args`,
  `checkpoint_version`, `iteration`, `model` (or `model{v}`), `optimizer`, `opt_param_scheduler`,
  `rng_state`, `num_floating_point_operations_so_far`; written by expert-data-parallel rank 0 of each
  (TP, PP, EP) coordinate, as Megatron-LM does (plus `distrib_optim.pt` with the distributed optimizer).
- `torch_dist`: `iter_{:07d}/` written through megatron-core `dist_checkpointing` (metadata.json,
  common.pt, .metadata, *.distcp), resharded on load; every pickled record (ShardedObjects: RNG state,
  optimizer param groups, per-rank parts) is read safely first (mindspeed_proxy.dist_records).
"""
from __future__ import annotations

import os
import random

import numpy as np
import torch

from mindspeed_proxy import dist_records
from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.training import checkpoint_parts as parts_io

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


def save_legacy(root: str, iteration: int, trainer, args, parts: dict | None = None) -> str:
    """Write Megatron-LM's legacy `torch` checkpoint of `trainer` at `iteration`; return this rank's dir.

    `parts` ({name: Stateful}, checkpoint_parts) become more keys of the rank file."""
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
        state.update(parts_io.legacy_entries(parts))
        os.makedirs(rank_dir, exist_ok=True)
        torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    torch.distributed.barrier()
    _write_tracker(root, iteration)
    torch.distributed.barrier()
    return rank_dir


def load_legacy(root: str, trainer, iteration: int | None = None, load_optim: bool = True,
                load_rng: bool = True, parts: dict | None = None) -> dict:
    """Load this rank's legacy checkpoint into `trainer`; return the checkpoint's non-tensor fields.

    `load_optim=False` keeps the fresh optimizer and scheduler (Megatron's --no-load-optim / --finetune);
    `load_rng=False` keeps this run's RNG state (--no-load-rng); `parts` get their saved state."""
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
    if load_optim:
        with torch.no_grad():  # main params are leaves that require grad; the load copies into them
            trainer.optimizer.load_state_dict(state["optimizer"])
            if trainer.cfg.use_distributed_optimizer:
                _drop_adam_steps(trainer.optimizer)
                trainer.optimizer.load_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))
                _restore_adam_steps(trainer.optimizer,
                                    _saved_steps(state["optimizer"], len(_chained(trainer.optimizer))))
        trainer.scheduler.load_state_dict(state["opt_param_scheduler"])
    else:
        trainer.optimizer.reload_model_params()  # fp32 main params from the loaded model weights
    if load_rng:
        set_rng_state(state["rng_state"][0])
    parts_io.restore(parts, state, iteration_dir(root, iteration))
    return {"iteration": state["iteration"], "args": state["args"]}


def _sharding_metadata(trainer) -> dict:
    from megatron.core import parallel_state as ps

    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    if trainer.cfg.use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    return metadata


def _sharded_state(trainer, is_loading: bool, with_optim: bool = True, with_rng: bool = True) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    metadata = _sharding_metadata(trainer)
    chunks = trainer.unwrapped()
    state = {}
    for i, chunk in enumerate(chunks):
        state[_model_key(i, len(chunks))] = chunk.sharded_state_dict(metadata=metadata)
    if with_optim:
        state["optimizer"] = trainer.optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                                  metadata=metadata)
    if not with_rng:
        return state
    pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    dp, dp_rank = (ps.get_data_parallel_world_size(with_context_parallel=True),
                   ps.get_data_parallel_rank(with_context_parallel=True))
    state["rng_state"] = ShardedObject("rng_state", [rng_state()], (pp, tp, dp), (pp_rank, tp_rank, dp_rank),
                                       replica_id=0)
    return state


def save_dist(root: str, iteration: int, trainer, args, parts: dict | None = None) -> str:
    """Write a `torch_dist` checkpoint through megatron-core dist_checkpointing; return its folder.

    `parts` ({name: Stateful}, checkpoint_parts) go to the common state, or per rank when they say so."""
    from megatron.core import dist_checkpointing

    folder = iteration_dir(root, iteration)
    if torch.distributed.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    torch.distributed.barrier()
    state = _sharded_state(trainer, is_loading=False)
    state.update(args=args, checkpoint_version=CHECKPOINT_VERSION, iteration=iteration,
                 opt_param_scheduler=trainer.scheduler.state_dict(),
                 num_floating_point_operations_so_far=0)
    state.update(parts_io.dist_entries(parts))
    metadata = {k: v for k, v in _sharding_metadata(trainer).items() if k != "dp_cp_group"}
    dist_checkpointing.save(state, folder, content_metadata=metadata)
    torch.distributed.barrier()
    _write_tracker(root, iteration)
    torch.distributed.barrier()
    return folder


def _ensure_optimizer_state(optimizer) -> None:
    """Give an un-stepped distributed optimizer its state tensors before a sharded load.

    Without Apex/TE, megatron-core's DistributedOptimizer.state_dict() asserts one 'step' value in the
    inner Adam state, which does not exist before the first step; Megatron's own dummy initialisation
    creates it, and the load then overwrites every value in place.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def _chained(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _saved_steps(optimizer_state: dict, count: int) -> list:
    """Adam step per chained optimizer, from the param groups Megatron stores ('step' key)."""
    parts = [optimizer_state[i] for i in range(count)] if count > 1 else [optimizer_state]
    steps = []
    for part in parts:
        groups = (part.get("optimizer") or {}).get("param_groups", [])
        values = {float(g["step"]) for g in groups if "step" in g}
        steps.append(values.pop() if len(values) == 1 else None)
    return steps


def _restore_adam_steps(optimizer, steps: list) -> None:
    """Give every Adam state its own 'step' tensor equal to the saved step.

    Without Apex/TE, megatron-core's DistributedOptimizer keeps Adam's step only in the param groups
    of its checkpoint and, on load, hands ONE tensor to every parameter state (torch's Adam then
    increments it once per parameter) or overwrites it with the template's dummy value. Both corrupt
    the bias correction after resuming; this restores one private step tensor per parameter.
    """
    for opt, step in zip(_chained(optimizer), steps):
        if step is None:
            continue
        for state in getattr(opt.optimizer, "state", {}).values():
            if state:
                state["step"] = torch.tensor(step, dtype=torch.float32)


def _drop_adam_steps(optimizer) -> None:
    """Remove 'step' from Adam states: megatron's legacy parameter-state load copies every state key
    from the file, which holds no 'step' (the non-Apex path keeps it in the param groups)."""
    for opt in _chained(optimizer):
        for state in getattr(getattr(opt, "optimizer", None), "state", {}).values():
            state.pop("step", None)


def _saved_layout(args) -> tuple:
    return (getattr(args, "tensor_model_parallel_size", 1), getattr(args, "pipeline_model_parallel_size", 1),
            getattr(args, "data_parallel_size", None), getattr(args, "expert_model_parallel_size", 1))


def _current_layout() -> tuple:
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_data_parallel_world_size(), ps.get_expert_model_parallel_world_size())


def load_dist(root: str, trainer, iteration: int | None = None, load_optim: bool = True,
              load_rng: bool = True, parts: dict | None = None) -> dict:
    """Load a `torch_dist` checkpoint into `trainer` (any TP/PP/EP it was saved with); flags as load_legacy."""
    from megatron.core import dist_checkpointing

    iteration = read_tracker(root) if iteration is None else iteration
    folder = iteration_dir(root, iteration)
    if not dist_checkpointing.check_is_distributed_checkpoint(folder):
        raise ValueError(f"--load {root}: {folder} is not a torch_dist checkpoint")
    # every record (and common.pt) unpickled with megatron-core's safe globals before megatron reads anything
    metadata = dist_records.read_metadata(folder)
    records = dist_records.read_records(folder, metadata)
    common = dist_records.read_common(folder, metadata, records=records)
    if _saved_layout(common["args"]) != _current_layout():
        # RNG records are sharded by (PP, TP, DP) and do not map onto another layout (Megatron-LM ignores
        # them too). Optimizer state does not reshard either: its chained dense/expert structure and the
        # distributed optimizer's dp_reshardable shards follow the layout. Model weights do reshard.
        load_rng = False
        if load_optim:
            raise ValueError(
                f"--load {root}: saved with (TP, PP, DP, EP) = {_saved_layout(common['args'])}, running with "
                f"{_current_layout()}; optimizer state cannot be resharded: add --no-load-optim"
            )
    if load_optim:
        _ensure_optimizer_state(trainer.optimizer)
    request = _sharded_state(trainer, is_loading=True, with_optim=load_optim, with_rng=load_rng)
    request.update(parts_io.dist_requests(parts, common, f"--load {root}"))
    loaded = dist_records.load(request, folder, records=records)
    chunks = trainer.unwrapped()
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[_model_key(i, len(chunks))], strict=True)
    if load_optim:
        with torch.no_grad():  # main params are leaves that require grad; the load copies into them
            trainer.optimizer.load_state_dict(loaded["optimizer"])
        if trainer.cfg.use_distributed_optimizer:
            _restore_adam_steps(trainer.optimizer,
                                _saved_steps(loaded["optimizer"], len(_chained(trainer.optimizer))))
        trainer.scheduler.load_state_dict(common["opt_param_scheduler"])
    else:
        trainer.optimizer.reload_model_params()  # fp32 main params from the loaded model weights
    if load_rng:
        rng = loaded["rng_state"]
        set_rng_state(rng[0] if isinstance(rng, list) else rng)
    parts_io.restore(parts, {**common, **{k: v for k, v in loaded.items() if k in (parts or {})}}, folder)
    return {"iteration": common["iteration"], "args": common["args"]}


def checkpoint_format(root: str, iteration: int | None = None) -> str:
    """'torch_dist' or 'torch' for the checkpoint under `root` (ValueError if neither)."""
    from megatron.core import dist_checkpointing

    named_by = "tracker names" if iteration is None else "--ckpt-step"
    iteration = read_tracker(root) if iteration is None else iteration
    folder = iteration_dir(root, iteration)
    if not os.path.isdir(folder):
        raise ValueError(f"--load {root}: {named_by} iteration {iteration} but {folder} is missing")
    if dist_checkpointing.check_is_distributed_checkpoint(folder):
        return "torch_dist"
    if any(name.startswith("mp_rank_") for name in os.listdir(folder)):
        return "torch"
    raise ValueError(f"--load {root}: {folder} holds neither mp_rank_* folders nor a torch_dist checkpoint")


def saver(fmt: str):
    """The save function of checkpoint format `fmt` ("torch_dist" or Megatron-LM's legacy "torch")."""
    return save_dist if fmt == "torch_dist" else save_legacy


def loader(fmt: str):
    """The load function of checkpoint format `fmt` ("torch_dist" or Megatron-LM's legacy "torch")."""
    return load_dist if fmt == "torch_dist" else load_legacy
