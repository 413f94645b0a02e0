"""The common state of a torch_dist checkpoint in megatron-core 0.19's form: a `common_state` record in the .distcp."""
import argparse
import os

import pytest
import torch

from mindspeed_proxy.proxy.io.dist.common import COMMON_STATE, read_common
from mindspeed_proxy.proxy.core.errors import ConversionError


class RunsCode:
    """A pickle whose load would run a shell command (what torch.distributed.checkpoint's own load would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def write(folder, record):
    """A torch_dist-style folder holding `record` under megatron-core 0.19's key, as torch's DCP writes objects."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    dcp.save({COMMON_STATE: record, "decoder.layers.mlp.router.weight": torch.zeros(2, 4)}, checkpoint_id=str(folder),
             no_dist=True, planner=DefaultSavePlanner(flatten_state_dict=False))  # as megatron's MCoreSavePlanner
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(folder)).read_metadata()


def test_the_record_is_read_without_a_common_pt(tmp_path):
    meta = write(tmp_path, [{"args": argparse.Namespace(num_experts=8), "iteration": 3}])
    assert not (tmp_path / "common.pt").exists()
    common = read_common(str(tmp_path), meta)
    assert common["iteration"] == 3 and common["args"].num_experts == 8


def test_a_record_that_runs_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    meta = write(tmp_path / "ckpt", [{"args": RunsCode(marker)}])
    with pytest.raises(ValueError) as info:
        read_common(str(tmp_path / "ckpt"), meta)
    message = str(info.value)
    assert COMMON_STATE in message and "unsupported type posix.system" in message  # the refused type is named
    assert "\n" not in message and not marker.exists()


def test_neither_form_is_named(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(ConversionError, match="missing common.pt and no common_state/shard_0_1 record"):
        read_common(str(tmp_path), FileSystemReader(str(tmp_path)).read_metadata())
