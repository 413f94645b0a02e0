"""The example trainer end to end: real megatron-core, embedded corpus, both checkpoint formats, bad input."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.testing import run_distributed, run_python
from mindspeed_proxy.training.loop import train

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "examples" / "train_moe.py")
SMALL = ["--num-layers", "2", "--log-interval", "5", "--lr-warmup-iters", "2"]


def steps(log_dir):
    """Step records of a run's metrics.jsonl, by iteration."""
    records = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    assert records[0]["type"] == "args"
    return {r["iteration"]: r for r in records[1:]}


def _resume_args(fmt, dist_opt):
    extra = SMALL + ["--expert-model-parallel-size", "2", "--ckpt-format", fmt, "--train-iters", "20"]
    return extra + (["--use-distributed-optimizer"] if dist_opt else [])


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory):
    """full_runs(fmt, dist_opt) -> folder of an uninterrupted 20-step run saved at 10 and 20 (run once)."""
    done = {}

    def get(fmt, dist_opt):
        if (fmt, dist_opt) not in done:
            full = tmp_path_factory.mktemp(f"full-{fmt}-{int(dist_opt)}")
            run_distributed(train, 2, _resume_args(fmt, dist_opt) + ["--save", str(full), "--save-interval", "10",
                                                                     "--log-dir", str(full / "logs")])
            done[fmt, dist_opt] = full
        return done[fmt, dist_opt]

    return get


def test_loss_decreases_on_embedded_corpus(full_runs):
    """The trainer's defaults on the embedded corpus (the legacy-format resume test's uninterrupted run)."""
    log = steps(full_runs("torch", False) / "logs")
    assert sorted(log) == list(range(1, 21))
    for record in log.values():
        assert {"iteration", "loss", "grad_norm", "lr", "tokens_per_s"} <= set(record)
    first = sum(log[i]["loss"] for i in range(1, 6)) / 5
    last = sum(log[i]["loss"] for i in range(16, 21)) / 5
    assert last < first - 0.3, (first, last)


@pytest.mark.parametrize("fmt,dist_opt", [("torch", False), ("torch", True), ("torch_dist", True),
                                          ("torch_dist", False)])
def test_resume_equals_uninterrupted(tmp_path, full_runs, fmt, dist_opt):
    """From the tracker (iteration 20 removed, the tracker set to 10), or with the tracker left at 20 from
    `--ckpt-step 10` (the distributed-optimizer cases)."""
    full = full_runs(fmt, dist_opt)
    resumed = tmp_path / "resumed"
    if dist_opt:
        shutil.copytree(full, resumed, ignore=shutil.ignore_patterns("logs"))
        step = ["--ckpt-step", "10"]
        assert (resumed / "latest_checkpointed_iteration.txt").read_text() == "20"
    else:
        shutil.copytree(full, resumed, ignore=shutil.ignore_patterns("iter_0000020", "logs"))
        (resumed / "latest_checkpointed_iteration.txt").write_text("10")
        step = []
    run_distributed(train, 2, _resume_args(fmt, dist_opt) + ["--load", str(resumed), *step,
                                                             "--log-dir", str(resumed / "logs")])
    a, b = steps(full / "logs"), steps(resumed / "logs")
    assert sorted(b) == list(range(11, 21))
    for it in range(11, 21):  # fp32 and a deterministic data order: bit-identical
        assert b[it]["loss"] == a[it]["loss"], it
        assert b[it]["grad_norm"] == a[it]["grad_norm"], it


LEGACY_KEYS = {"args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler",
               "rng_state", "num_floating_point_operations_so_far"}


@pytest.mark.parametrize("tp,ep,folders", [
    (1, 2, {"mp_rank_00_000", "mp_rank_00_001"}),
    (2, 1, {"mp_rank_00", "mp_rank_01"}),
])
def test_legacy_layout_matches_megatron_lm(tmp_path, tp, ep, folders):
    run_distributed(train, 2, SMALL + ["--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size",
                                       str(ep), "--train-iters", "3", "--ckpt-format", "torch",
                                       "--save", str(tmp_path)])
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3"
    iter_dir = tmp_path / "iter_0000003"
    assert {p.name for p in iter_dir.iterdir()} == folders
    for folder in folders:
        assert {p.name for p in (iter_dir / folder).iterdir()} == {"model_optim_rng.pt"}
        state = safe_torch_load(str(iter_dir / folder / "model_optim_rng.pt"))
        assert set(state) == LEGACY_KEYS
        assert state["checkpoint_version"] == 3.0 and state["iteration"] == 3
        args = state["args"]
        assert (args.tensor_model_parallel_size, args.expert_model_parallel_size) == (tp, ep)
        assert args.num_experts == 8 and args.world_size == 2
        assert not [k for k in vars(args) if k.startswith("owns_")]  # process state stays out of saved args
        assert isinstance(state["rng_state"], list) and "rng_tracker_states" in state["rng_state"][0]
        experts = [k for k in state["model"] if ".local_experts." in k and k.endswith("linear_fc1.weight")]
        assert len(experts) == 2 * 8 // ep  # 2 MoE layers x local experts of this EP rank


def _garbage_dataset(tmp_path):
    prefix = tmp_path / "garbage"
    (tmp_path / "garbage.idx").write_bytes(os.urandom(512))
    (tmp_path / "garbage.bin").write_bytes(os.urandom(512))
    return str(prefix)


def _one_checkpoint(tmp_path) -> str:
    """A folder with a tracker naming iteration 3 and that iteration's (empty) folder."""
    root = tmp_path / "ckpt"
    (root / "iter_0000003").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    return str(root)


@pytest.mark.parametrize("case", ["ep-does-not-divide", "missing-load", "missing-ckpt-step", "not-a-dataset"])
def test_bad_input_one_error_line_nothing_written(tmp_path, case):
    work = tmp_path / "cwd"
    work.mkdir()
    save = tmp_path / "out"
    flags = {
        "ep-does-not-divide": ["--num-experts", "6", "--expert-model-parallel-size", "4"],
        "missing-load": ["--load", str(tmp_path / "does-not-exist")],
        "missing-ckpt-step": ["--load", _one_checkpoint(tmp_path), "--ckpt-step", "7"],
        "not-a-dataset": ["--data-path", _garbage_dataset(tmp_path)],
    }[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    if case == "ep-does-not-divide":  # a new interpreter: one error line also when its imports print warnings
        proc = subprocess.run([sys.executable, TRAIN, *flags, "--save", str(save)], cwd=work,
                              capture_output=True, text=True, timeout=120)
    else:  # forked from the fork server (torch / megatron-core imported): ~6 CPU-s less
        proc = run_python([TRAIN, *flags, "--save", str(save)], cwd=work, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("train_moe.py: error: "), proc.stderr
    expected = {"ep-does-not-divide": "--expert-model-parallel-size 4", "missing-load": "does-not-exist",
                "missing-ckpt-step": "--ckpt-step iteration 7 but", "not-a-dataset": "garbage"}[case]
    assert expected in lines[0]
    assert not save.exists() and list(work.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_torch_dist_saved_at_ep2_loads_at_ep1_and_finetune_loads_weights(tmp_path, capfd):
    """dist_checkpointing reshards the model from EP=2 to EP=1; optimizer state needs --no-load-optim."""
    base = SMALL + ["--ckpt-format", "torch_dist", "--train-iters", "12"]
    full = tmp_path / "ep2"
    run_distributed(train, 2, base + ["--expert-model-parallel-size", "2", "--save", str(full),
                                      "--save-interval", "10", "--log-dir", str(full / "logs")])
    (full / "latest_checkpointed_iteration.txt").write_text("10")
    with pytest.raises(Exception, match="SystemExit: 2"):
        run_distributed(train, 1, base + ["--load", str(full), "--log-dir", str(tmp_path / "refused")])
    assert "optimizer state cannot be resharded: add --no-load-optim" in capfd.readouterr().err
    assert not (tmp_path / "refused").exists()
    run_distributed(train, 1, base + ["--load", str(full), "--no-load-optim", "--log-dir", str(tmp_path / "ep1")])
    a, b = steps(full / "logs"), steps(tmp_path / "ep1")
    assert sorted(b) == [11, 12]
    # step 11's forward/backward uses only the loaded weights: equal within fp32 round-off
    assert b[11]["loss"] == pytest.approx(a[11]["loss"], rel=1e-5)
    assert b[11]["grad_norm"] == pytest.approx(a[11]["grad_norm"], rel=1e-5)
    run_distributed(train, 1, base + ["--load", str(full), "--finetune", "--no-load-optim", "--no-load-rng",
                                      "--train-iters", "3", "--log-dir", str(tmp_path / "ft")])
    fresh = steps(full / "logs")[1]["loss"]
    tuned = steps(tmp_path / "ft")
    assert sorted(tuned) == [1, 2, 3]
    assert tuned[1]["loss"] < fresh - 0.5, (tuned[1]["loss"], fresh)


def test_safe_load_keeps_process_wide_allowlist(tmp_path):
    """safe_torch_load must not remove globals that were allowed before it ran (megatron relies on them)."""
    import argparse

    import torch

    torch.serialization.add_safe_globals([argparse.Namespace])
    torch.save({"args": argparse.Namespace(a=1)}, tmp_path / "x.pt")
    assert safe_torch_load(str(tmp_path / "x.pt"))["args"].a == 1
    assert argparse.Namespace in torch.serialization.get_safe_globals()
