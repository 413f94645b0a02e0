"""The converter reads checkpoints with megatron-core's own safe globals: Megatron's own types in `args`
load; a pickle that would run code, or a type of another fork, is refused with the type named (nothing
runs, nothing is written, exit 2); --trust-checkpoint is the explicit, warned opt-in for the latter."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.proxy.cli import main

from fork_types import ForkBackend  # noqa: E402  (tests/proxy is on sys.path under pytest)

REPO = Path(__file__).resolve().parents[2]
ITER = "iter_0000002"
FLAGS = ["--target-expert-parallel-size", "1", "--target-num-experts", "4"]


class RunsCode:
    """Unpickling this calls os.system: the marker file appears if the pickle is ever executed."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _edit(path, fn):
    state = safe_torch_load(path, trust=True)
    fn(state)
    torch.save(state, path)


def megatron_types(state):
    """What Megatron-LM's own args / top-level entries hold besides plain values."""
    from megatron.core.enums import ModelType
    from megatron.core.rerun_state_machine import RerunMode
    from megatron.core.transformer.enums import AttnBackend, CudaGraphScope

    args = state["args"]
    args.attention_backend = AttnBackend.auto
    args.cuda_graph_scope = [CudaGraphScope.full_iteration]
    args.model_type = ModelType.encoder_or_decoder
    args.rerun_mode = RerunMode.DISABLED
    args.save = Path("/nonexistent/ckpt")  # PosixPath, as argparse type=Path flags leave it


def _one_error(err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("convert_to_proxy.py: error: "), err
    return lines[0]


def test_megatron_types_in_args_convert(checkpoints, tmp_path, capsys):
    """Legacy: args with AttnBackend, CudaGraphScope, ModelType, RerunMode, PosixPath convert; the proxy's
    args keep them (Megatron-LM reads them back the same way)."""
    from megatron.core.transformer.enums import AttnBackend

    root = str(tmp_path / "ckpt")
    shutil.copytree(checkpoints("ep2_bias"), root)
    for name in ("mp_rank_00_000", "mp_rank_00_001"):
        _edit(os.path.join(root, ITER, name, "model_optim_rng.pt"), megatron_types)
    out = tmp_path / "out"
    assert main(["--load", root, "--save", str(out), *FLAGS]) == 0, capsys.readouterr().err
    args = safe_torch_load(str(out / ITER / "mp_rank_00" / "model_optim_rng.pt"))["args"]
    assert args.attention_backend is AttnBackend.auto and args.num_experts == 4


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_pickle_that_runs_code_is_refused(checkpoints, dist_checkpoints, tmp_path, hash_folder, fmt):
    """A __reduce__ calling os.system in args: refused naming posix.system and the file, exit 2, the
    marker never appears, no OUT_DIR, source unchanged (the converter runs as a user would run it)."""
    root = str(tmp_path / "ckpt")
    shutil.copytree((checkpoints if fmt == "torch" else dist_checkpoints)("ep2_bias"), root)
    marker = tmp_path / "marker"
    target = os.path.join(root, ITER, "mp_rank_00_001", "model_optim_rng.pt") if fmt == "torch" else \
        os.path.join(root, ITER, "common.pt")
    _edit(target, lambda s: setattr(s["args"], "exploit", RunsCode(marker)))
    assert not marker.exists()
    before = hash_folder(root)
    run = subprocess.run([sys.executable, str(REPO / "convert_to_proxy.py"), "--load", root, "--save",
                          str(tmp_path / "out"), *FLAGS], capture_output=True, text=True, timeout=300)
    line = _one_error(run.stderr)
    assert run.returncode == 2
    assert f"unsupported type {os.system.__module__}.system in {target}" in line, line
    assert "truncated" not in line
    assert not marker.exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"] and hash_folder(root) == before


def test_fork_type_refused_then_trusted(checkpoints, tmp_path, capsys):
    """A fork's own enum in args: refused by default naming it; --trust-checkpoint converts with a warning."""
    root = str(tmp_path / "ckpt")
    shutil.copytree(checkpoints("ep2_bias"), root)
    for name in ("mp_rank_00_000", "mp_rank_00_001"):
        _edit(os.path.join(root, ITER, name, "model_optim_rng.pt"),
              lambda s: setattr(s["args"], "fork_backend", ForkBackend.FAST))
    out = tmp_path / "out"
    assert main(["--load", root, "--save", str(out), *FLAGS]) == 2
    line = _one_error(capsys.readouterr().err)
    assert "unsupported type fork_types.ForkBackend in " in line and "--trust-checkpoint" in line, line
    assert not out.exists()
    assert main(["--load", root, "--save", str(out), *FLAGS, "--trust-checkpoint"]) == 0
    err = capsys.readouterr().err
    assert "warning: --trust-checkpoint" in err and "arbitrary code" in err
    args = safe_torch_load(str(out / ITER / "mp_rank_00" / "model_optim_rng.pt"), trust=True)["args"]
    assert args.fork_backend is ForkBackend.FAST and args.num_experts == 4


def test_truncated_and_damaged_are_told_apart(dist_checkpoints, tmp_path):
    """common.pt cut in half is 'truncated'; a refused type never is; a non-zip file is 'not a torch checkpoint'."""
    from mindspeed_proxy.checkpoint_io import CheckpointReadError, TruncatedCheckpointError

    src = os.path.join(dist_checkpoints("ep2_bias"), ITER, "common.pt")
    data = open(src, "rb").read()
    cut, junk = tmp_path / "cut.pt", tmp_path / "junk.pt"
    cut.write_bytes(data[: len(data) // 2])
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(TruncatedCheckpointError, match=r"^truncated file .*cut\.pt"):
        safe_torch_load(str(cut))
    with pytest.raises(CheckpointReadError, match="not a torch checkpoint") as info:
        safe_torch_load(str(junk))
    assert not isinstance(info.value, TruncatedCheckpointError)


def test_first_load_leaves_megatron_registrations(tmp_path):
    """A first safe_torch_load in a fresh process (which imports megatron.core, registering its list) leaves
    megatron's registrations in place: megatron's own later loads still accept its types."""
    path = tmp_path / "plain.pt"
    torch.save({"x": torch.ones(2)}, path)
    code = ("import argparse, torch\n"
            "from mindspeed_proxy.checkpoint_io import safe_torch_load\n"
            f"safe_torch_load({str(path)!r})\n"
            "from megatron.core.transformer.enums import AttnBackend\n"
            "allowed = torch.serialization.get_safe_globals()\n"
            "assert argparse.Namespace in allowed and AttnBackend in allowed, allowed\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
