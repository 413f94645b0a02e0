"""Stateful parts of a training checkpoint beyond model / optimizer / RNG (e.g. the mechanism monitor).

The trainer passes `parts={name: part}` to the checkpointer; each part has `state_dict()` and
`load_state_dict(state, where)` and is read only when the checkpoint is written (nothing is copied before).
A part is rank-agnostic unless it sets `per_rank = True`:

- legacy `torch`: each part is one more key of `model_optim_rng.pt` (every written rank file holds it);
- `torch_dist`: a rank-agnostic part is a plain value of the common state (`common.pt`, written by rank 0);
  a per-rank part is a ShardedObject indexed by global rank, listed under PER_RANK_KEY in the common state so
  a load asks only for what was saved (and refuses another world size with a message).

A part absent from the checkpoint may read an older form (`fallback(folder)`, e.g. the monitor's side JSON).
"""
from __future__ import annotations

from typing import Optional

PER_RANK_KEY = "checkpoint_parts_per_rank"  # common state: {"world": N, "names": [per-rank part names]}


def _per_rank(part) -> bool:
    return bool(getattr(part, "per_rank", False))


def legacy_entries(parts: Optional[dict]) -> dict:
    """{name: state} of every part with something to save, for the legacy rank file."""
    out = {}
    for name, part in (parts or {}).items():
        state = part.state_dict()
        if state is not None:
            out[name] = state
    return out


def dist_entries(parts: Optional[dict]) -> dict:
    """Entries to merge into a torch_dist save: common values, per-rank ShardedObjects and their index."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    out, per_rank = {}, []
    for name, part in (parts or {}).items():
        state = part.state_dict()
        if state is None:
            continue
        if _per_rank(part):
            out[name] = ShardedObject(f"checkpoint_parts.{name}", state, (world,), (rank,), replica_id=0)
            per_rank.append(name)
        else:
            out[name] = state
    if per_rank:
        out[PER_RANK_KEY] = {"world": world, "names": per_rank}
    return out


def dist_requests(parts: Optional[dict], common: dict, where: str) -> dict:
    """ShardedObject requests for the per-rank parts that `common` says were saved (load side)."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    index = common.get(PER_RANK_KEY) or {"world": None, "names": []}
    wanted = [n for n, p in (parts or {}).items() if _per_rank(p) and n in index["names"]]
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if wanted and index["world"] != world:
        raise ValueError(f"{where}: per-rank state {', '.join(wanted)} was saved by {index['world']} ranks, "
                         f"this run has {world}; it cannot be resharded")
    return {n: ShardedObject(f"checkpoint_parts.{n}", None, (world,), (rank,), replica_id=0) for n in wanted}


def restore(parts: Optional[dict], saved: dict, folder: str) -> None:
    """Hand each part its saved state (or its `fallback(folder)` when the checkpoint has none)."""
    for name, part in (parts or {}).items():
        state = saved.get(name)
        where = f"{folder}: {name!r}"
        if state is None and hasattr(part, "fallback"):
            state, where = part.fallback(folder)
        part.load_state_dict(state, where)
