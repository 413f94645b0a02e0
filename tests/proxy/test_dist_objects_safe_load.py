"""Every pickled record of a torch_dist checkpoint (ShardedObjects) is read with megatron-core's safe globals.

The source: a real torch_dist checkpoint of our trainer, written again by megatron's own
`dist_checkpointing.save` with one expert `_extra_state` ShardedObject holding a pickle that runs a shell
command (`touch "$SAFELOAD_MARKER"`). The converter (`--features weights` and `outputs`), our trainer's
`--load` and the RL loop's `--load` refuse it in one line naming the object's key, exit 2, the command never
runs, nothing is written; with `--trust-checkpoint` the converter loads it and the command runs (so the
refusal tests can fail). The trainer with the monitor also refuses such a pickle in the monitor's state
(the common state, `common.pt`) in one line.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mindspeed_proxy.testing import run_distributed
from mindspeed_proxy.training.loop import train

from helpers import CONFIGS, TINY  # noqa: E402  (tests/proxy is on sys.path under pytest)

REPO = Path(__file__).resolve().parents[2]
ITER = "iter_0000002"
PLANTED = "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_0.3_2.8"  # layer 0, expert 3
FLAGS = ["--target-expert-parallel-size", "1", "--target-num-experts", "4"]


class RunsCode:
    """Unpickling this runs a shell command that creates the file $SAFELOAD_MARKER names."""

    def __reduce__(self):
        return os.system, ('touch "$SAFELOAD_MARKER"',)


def plant(src_root: str, dst_root: str, key: str) -> None:
    """Write torch_dist checkpoint `src_root` again under `dst_root` with megatron's dist_checkpointing.save
    (one process): every tensor and object as stored, object `key` replaced by RunsCode()."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from mindspeed_proxy import dist_records

    src, dst = os.path.join(src_root, ITER), os.path.join(dst_root, ITER)
    metadata = dist_records.read_metadata(src)
    records = dist_records.read_records(src, metadata)
    state = dict(dist_records.read_common(src, metadata, records=records))
    content = state.pop("content_metadata", None)
    requests = {k: ShardedTensor.from_rank_offsets(k, torch.empty(v.size, dtype=v.properties.dtype))
                for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    tensors = TorchDistLoadShardedStrategy().load(requests, src)
    state["tensors"] = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}
    objects = {}
    for name, value in records.items():
        empty = ShardedObject.empty_from_unique_key(name)
        data = RunsCode() if name == key else value[0]
        objects[name] = ShardedObject(empty.key, data, empty.global_shape, empty.global_offset, replica_id=0)
    assert key in objects, sorted(objects)
    state["objects"] = objects
    os.makedirs(dst)
    dist_checkpointing.save(state, dst, content_metadata=content)
    with open(os.path.join(dst_root, "latest_checkpointed_iteration.txt"), "w", encoding="utf-8") as fh:
        fh.write("2")


@pytest.fixture(scope="module")
def planted(dist_checkpoints, tmp_path_factory):
    """The ep2_bias torch_dist checkpoint re-saved with the expert object PLANTED running a command."""
    base = tmp_path_factory.mktemp("planted")
    np.save(base / "calib.npy", np.random.default_rng(0).integers(0, 256, size=(4, 64)))
    run_distributed(plant, 1, dist_checkpoints("ep2_bias"), str(base / "ckpt"), PLANTED, timeout=300)
    return str(base / "ckpt")


def _calibration(features, root):
    return ["--features", features] + (["--calibration-data", os.path.join(os.path.dirname(root), "calib.npy")]
                                       if features == "outputs" else [])


def _convert(root, out, marker, *extra):
    env = {**os.environ, "SAFELOAD_MARKER": str(marker)}
    return subprocess.run([sys.executable, str(REPO / "convert_to_proxy.py"), "--load", root, "--save", str(out),
                           *FLAGS, *extra], capture_output=True, text=True, timeout=600, env=env)


def _error_line(stderr, prog):
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), stderr
    return lines[0]


@pytest.mark.parametrize("features", ["weights", "outputs"])
def test_converter_refuses_the_object_naming_its_key(planted, hash_folder, tmp_path, features):
    """One line naming the key and the refused global, exit 2, the command never runs, no OUT_DIR, source unchanged."""
    marker, out = tmp_path / "marker", tmp_path / "out"
    before = hash_folder(planted)
    run = _convert(planted, out, marker, *_calibration(features, planted))
    line = _error_line(run.stderr, "convert_to_proxy.py")
    assert run.returncode == 2
    assert f"unsupported type {os.system.__module__}.system in " in line and f"(object {PLANTED})" in line, line
    assert "--trust-checkpoint" in line
    assert not marker.exists()
    assert sorted(os.listdir(tmp_path)) == [] and hash_folder(planted) == before


def test_converter_with_trust_checkpoint_runs_it(planted, tmp_path):
    """--trust-checkpoint: the same checkpoint loads with full unpickling (warning printed), the command runs
    (the marker appears: the refusal above is what kept it from running) and the proxy is written."""
    marker, out = tmp_path / "marker", tmp_path / "out"
    run = _convert(planted, out, marker, *_calibration("outputs", planted), "--trust-checkpoint")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "warning: --trust-checkpoint" in run.stderr
    assert marker.exists()
    assert (out / ITER / ".metadata").is_file()


def _rl_main(argv):
    from mindspeed_proxy.rl.train import main

    main(argv)


def _with_runs_code_in_monitor_state(path):
    state = torch.load(path, weights_only=False)
    state["mechanism_monitor"] = RunsCode()
    torch.save(state, path)


@pytest.mark.parametrize("case", ["trainer", "rl", "trainer-monitor-state"])
def test_trainer_and_rl_load_refuse_it(planted, dist_checkpoints, tmp_path, capfd, case):
    """Our trainer's and the RL loop's --load: one line naming the object's key (or common.pt holding the
    monitor's state), exit 2, the command never runs, no log folder; the load reads every record first."""
    import shutil

    root, where = planted, f"(object {PLANTED})"
    if case == "trainer-monitor-state":  # the monitor's state is a plain value of the common state
        root = str(tmp_path / "ckpt")
        shutil.copytree(dist_checkpoints("ep2_bias"), root)  # the trainer's own checkpoint, no planted object
        common = os.path.join(root, ITER, "common.pt")
        _with_runs_code_in_monitor_state(common)
        where = f"in {common}: "
    marker, log = tmp_path / "marker", tmp_path / "logs"
    env = {"SAFELOAD_MARKER": str(marker)}
    flags = TINY + CONFIGS["ep2_bias"][1][2:]  # without --expert-model-parallel-size 2: one process
    if case == "rl":
        fn, argv = _rl_main, ["--num-layers", "2", "--grpo-prompts-per-step", "2", "--grpo-group-size", "2",
                              "--micro-batch-size", "4", "--train-iters", "1", "--rl-eval-prompts", "0"]
    else:
        fn, argv = train, flags + (["--enable-mechanism-monitor"] if case == "trainer-monitor-state" else [])
    with pytest.raises(Exception, match="SystemExit: 2"):
        run_distributed(fn, 1, argv + ["--load", root, "--log-dir", str(log)], env=env, timeout=300)
    err = [line for line in capfd.readouterr().err.splitlines() if ": error: " in line]
    assert len(err) == 1 and f"unsupported type {os.system.__module__}.system" in err[0] and where in err[0], err
    assert not marker.exists()
    # the monitor's JSONL sink writes its first record when the monitor is built, before the load
    assert not log.exists() if case != "trainer-monitor-state" else not (log / "metrics.jsonl").exists()
