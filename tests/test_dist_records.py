"""dist_records.load: megatron's dist_checkpointing.load with the requested ShardedObjects filled from the records
read safely; torch.distributed.checkpoint's own object unpickling (load_bytes, weights_only=False) never runs."""
import os

from mindspeed_proxy.testing import run_distributed


def _load_without_load_bytes(folder: str) -> dict:
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from mindspeed_proxy import dist_records

    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    saved = {"w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0),
             "nested": [ShardedObject("rng", {"step": 3, "state": torch.ones(2)}, (1,), (0,), replica_id=0),
                        {"o": ShardedObject("extra", None, (1,), (0,), replica_id=0)}],
             "iteration": 7}
    os.makedirs(folder)
    dist_checkpointing.save(saved, folder)

    def request():
        return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4)),
                "nested": [ShardedObject("rng", None, (1,), (0,)), {"o": ShardedObject("extra", None, (1,), (0,))}]}

    calls = []
    original = DefaultLoadPlanner.load_bytes

    def counted(self, item, value):
        calls.append(item.dest_index.fqn)
        return original(self, item, value)

    DefaultLoadPlanner.load_bytes = counted
    try:
        ours = dist_records.load(request(), folder)
        ours_calls = list(calls)
        dist_checkpointing.load(request(), folder)  # megatron's own load: its objects go through load_bytes
    finally:
        DefaultLoadPlanner.load_bytes = original
    return {"ours_calls": ours_calls, "megatron_calls": sorted(calls), "w": ours["w"].tolist(),
            "rng": ours["nested"][0], "extra": ours["nested"][1]["o"], "iteration": ours["iteration"],
            "expected_w": weight.tolist()}


def test_objects_come_from_the_safe_records(tmp_path):
    """Tensor and common values as megatron loads them, objects in their nested places from the records; the
    planner's load_bytes is called by megatron's own load (so the check can fail) and never by ours."""
    out, = run_distributed(_load_without_load_bytes, 1, str(tmp_path / "ckpt"), timeout=300)
    assert out["ours_calls"] == []
    assert out["megatron_calls"] == ["extra/shard_0_1", "rng/shard_0_1"]
    assert out["w"] == out["expected_w"] and out["iteration"] == 7
    assert out["rng"]["step"] == 3 and out["rng"]["state"].tolist() == [1.0, 1.0] and out["extra"] is None
    assert os.path.isfile(tmp_path / "ckpt" / ".metadata")
