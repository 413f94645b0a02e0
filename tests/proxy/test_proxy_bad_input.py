"""Every bad input: one error line, exit status 2, no OUT_DIR (nor temp folder) left, source unchanged."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.proxy.cli import main
from mindspeed_proxy.testing import run_python

REPO = Path(__file__).resolve().parents[2]
ITER = "iter_0000002"


def _file(root, name):
    return os.path.join(root, ITER, name, "model_optim_rng.pt")


def _edit(path, fn):
    state = safe_torch_load(path)
    fn(state)
    torch.save(state, path)


def _rename_experts(state):
    state["model"] = {k.replace(".local_experts.", ".my_experts."): v for k, v in state["model"].items()}


def _break(case, root, work):
    """Damage the copy at `root` for `case`; return (load, save, extra flags, expected message fragment)."""
    out = str(work / "out")
    if case == "missing-path":
        return str(work / "nope"), out, [], "no such directory"
    if case == "not-a-checkpoint":
        os.makedirs(work / "junk")
        (work / "junk" / "readme.txt").write_text("hello")
        return str(work / "junk"), out, [], "not a Megatron checkpoint"
    if case == "missing-shard":
        shutil.rmtree(os.path.join(root, ITER, "mp_rank_00_001"))
        return root, out, [], "missing shard mp_rank_00_001"
    if case == "truncated-shard":
        path = _file(root, "mp_rank_00_001")
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
        return root, out, [], "truncated file"
    if case == "args-disagree-between-files":
        _edit(_file(root, "mp_rank_00_001"), lambda s: setattr(s["args"], "expert_model_parallel_size", 4))
        return root, out, [], "inconsistent EP/TP"
    if case == "folders-disagree-with-args":
        for name in ("mp_rank_00_000", "mp_rank_00_001"):
            _edit(_file(root, name), lambda s: setattr(s["args"], "expert_model_parallel_size", 1))
        return root, out, [], "inconsistent EP/TP"
    if case == "experts-disagree-with-args":
        for name in ("mp_rank_00_000", "mp_rank_00_001"):
            _edit(_file(root, name), lambda s: setattr(s["args"], "num_experts", 16))
        return root, out, [], "holds 4 local experts"
    if case == "k-invalid":
        return root, out, ["--target-num-experts", "3"], "nearest valid K: 2, 4"
    if case == "unknown-expert-layout":
        for name in ("mp_rank_00_000", "mp_rank_00_001"):
            _edit(_file(root, name), _rename_experts)
        return root, out, [], "unknown expert layout"
    if case == "out-exists":
        os.makedirs(out)
        (Path(out) / "keep.txt").write_text("mine")
        return root, out, [], "already exists"
    if case == "out-inside-ckpt":
        return root, os.path.join(root, "proxy"), [], "inside --load"
    raise AssertionError(case)


CASES = ["missing-path", "not-a-checkpoint", "missing-shard", "truncated-shard", "args-disagree-between-files",
         "folders-disagree-with-args", "experts-disagree-with-args", "k-invalid", "unknown-expert-layout",
         "out-exists", "out-inside-ckpt"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input(checkpoints, tmp_path, capsys, hash_folder, case):
    root = str(tmp_path / "ckpt")
    shutil.copytree(checkpoints("ep2_bias"), root)
    load, save, extra, fragment = _break(case, root, tmp_path)
    flags = ["--target-expert-parallel-size", "2", "--target-num-experts", "4"]
    flags = flags[:2] + extra if extra else flags
    before = hash_folder(load) if os.path.isdir(load) else None
    existed = os.path.exists(save)
    listing = sorted(os.listdir(tmp_path))
    rc = main(["--load", load, "--save", save, *flags])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("convert_to_proxy.py: error: "), err
    assert fragment in err[0], err[0]
    assert os.path.exists(save) == existed
    assert sorted(os.listdir(tmp_path)) == listing  # no temporary folder left beside OUT_DIR
    if before is not None:
        assert hash_folder(load) == before
    if case == "out-exists":
        assert (Path(save) / "keep.txt").read_text() == "mine"


def test_script_dry_run_writes_nothing_then_refuses_cleanly(checkpoints, tmp_path, hash_folder):
    src = checkpoints("ep2_bias")
    before = hash_folder(src)
    base = [sys.executable, str(REPO / "convert_to_proxy.py"), "--load", src, "--save", str(tmp_path / "out"),
            "--target-expert-parallel-size", "1"]
    dry = run_python(base[1:] + ["--target-num-experts", "4", "--dry-run"], timeout=120)  # forked: ~6 CPU-s less
    assert dry.returncode == 0, dry.stderr
    assert "layer 0: keep [" in dry.stdout and "bytes to write" in dry.stdout and "EP0: new 0..3" in dry.stdout
    assert list(tmp_path.iterdir()) == []
    bad = subprocess.run(base + ["--target-num-experts", "1"], capture_output=True, text=True, timeout=120)
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode == 2 and len(lines) == 1 and "moe_router_topk = 2" in lines[0], bad.stderr
    assert list(tmp_path.iterdir()) == [] and hash_folder(src) == before


def test_overwrite_replaces_only_after_success(checkpoints, tmp_path, capsys):
    src = checkpoints("ep2_bias")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    flags = ["--load", src, "--save", str(out), "--target-expert-parallel-size", "1"]
    assert main(flags + ["--target-num-experts", "1", "--overwrite"]) == 2  # refused: old content stays
    assert (out / "old.txt").read_text() == "old"
    assert main(flags + ["--target-num-experts", "4", "--overwrite"]) == 0
    assert not (out / "old.txt").exists() and (out / "proxy_manifest.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    flags = "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 1 " \
        "--num-experts 4 --ckpt-format torch"
    assert f"launch flags: {flags} --load {out} --finetune --no-load-optim --no-load-rng" in capsys.readouterr().out


def test_kmeans_without_scikit_learn_is_one_line_naming_the_extra(checkpoints, tmp_path, hash_folder):
    src = checkpoints("ep2_bias")
    before = hash_folder(src)
    argv = ["convert_to_proxy.py", "--load", src, "--save", str(tmp_path / "out"), "--target-expert-parallel-size",
            "1", "--target-num-experts", "4", "--cluster", "kmeans"]
    code = (f"import runpy, sys; sys.modules['sklearn'] = None; sys.argv = {argv!r}; "
            f"runpy.run_path({str(REPO / 'convert_to_proxy.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--cluster kmeans" in lines[0] and "pip install 'mindspeed-proxy[proxy]'" in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == [] and hash_folder(src) == before
