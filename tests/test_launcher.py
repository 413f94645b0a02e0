"""The multi-rank test launcher: ranks forked from the preloading fork server see the caller's streams,
environment, cwd and sys.path, report failures, and compute bit for bit what fresh interpreters compute."""
import os
import sys

import pytest

from mindspeed_proxy.testing import DistributedTestError, run_distributed
from mindspeed_proxy.testing.batches import synthetic_microbatches
from mindspeed_proxy.testing.parallel import init_parallel


def what_a_rank_sees(tag):
    """Print to both streams and return the caller-side state a rank must inherit."""
    import torch.distributed as dist

    print(f"out-{tag}-{dist.get_rank()}", flush=True)
    print(f"err-{tag}-{dist.get_rank()}", file=sys.stderr, flush=True)
    return {"env": os.environ.get("LAUNCHER_TEST_VALUE"), "cwd": os.getcwd(), "path": list(sys.path),
            "world": dist.get_world_size(), "pid": os.getpid()}


def fail_on_rank_one(how):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        if how == "raise":
            raise ValueError("rank one refuses")
        os._exit(7)
    return True


def die_on_one_then_fail_on_zero():
    import time

    import torch.distributed as dist

    dist.barrier()  # both ranks past gloo's connect
    if dist.get_rank() == 1:
        os._exit(7)
    time.sleep(0.3)
    raise RuntimeError("rank zero lost its peer")


def train_steps():
    """Five steps of the tiny MoE at EP=2: losses and grad norms."""
    from mindspeed_proxy.layout_init import global_init
    from mindspeed_proxy.tiny_moe import TinyMoEConfig
    from mindspeed_proxy.training.engine import TrainConfig, Trainer, microbatch_sample_ids

    init_parallel(ep=2)
    model_cfg, train_cfg = TinyMoEConfig(num_layers=2), TrainConfig(micro_batch_size=2, global_batch_size=4)
    trainer = Trainer(model_cfg, train_cfg, init_fn=lambda m: global_init(m, seed=3))
    out = []
    for it in range(5):
        result = trainer.train_step(synthetic_microbatches(microbatch_sample_ids(train_cfg, it), 64,
                                                           model_cfg.vocab_size))
        out.append((result["loss"], result["grad_norm"]))
    return out


def test_ranks_see_the_callers_streams_env_cwd_and_path(tmp_path, capfd, monkeypatch):
    with capfd.disabled():  # the fork server starts (if it has not) outside this test's capture, as it would
        run_distributed(fail_on_rank_one, 1, "raise")  # rank 0 returns, prints nothing
    monkeypatch.setenv("LAUNCHER_TEST_VALUE", "late")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = run_distributed(what_a_rank_sees, 2, "now")
    captured = capfd.readouterr()
    for rank in range(2):
        assert f"out-now-{rank}" in captured.out and f"err-now-{rank}" in captured.err
        assert seen[rank]["env"] == "late" and seen[rank]["cwd"] == str(tmp_path)
        assert seen[rank]["path"][0] == str(tmp_path) and seen[rank]["world"] == 2
    assert seen[0]["pid"] != seen[1]["pid"] != os.getpid()


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_failing_rank_is_reported(how):
    expected = "rank one refuses" if how == "raise" else "exit code 7"
    with pytest.raises(DistributedTestError, match=expected):
        run_distributed(fail_on_rank_one, 2, how, timeout=120)


def test_a_silent_death_is_reported_before_the_error_it_caused():
    """A rank that dies without a word (here os._exit; in CI once while its peer was still in gloo's connect) makes
    its peer fail; the report names the death first, then the peer's traceback."""
    with pytest.raises(DistributedTestError) as err:
        run_distributed(die_on_one_then_fail_on_zero, 2, timeout=120)
    message = str(err.value)
    assert message.startswith("rank 1 of die_on_one_then_fail_on_zero died with exit code 7; then rank 0 "), message
    assert "rank zero lost its peer" in message


def test_forked_ranks_train_bit_identically_to_fresh_interpreters(monkeypatch):
    forked = run_distributed(train_steps, 2)
    monkeypatch.setenv("MINDSPEED_PROXY_SPAWN", "1")
    spawned = run_distributed(train_steps, 2)
    assert forked == spawned and forked[0] == forked[1]
    assert all(loss == loss for loss, _ in forked[0])  # finite numbers, not an empty run


def parent_pid():
    return os.getppid()


def test_a_different_numeric_env_starts_fresh_interpreters(monkeypatch):
    """Settings read when torch / MKL load (determinism.NUMERIC_ENV) cannot reach a rank forked from the
    server that imported them: such ranks are spawned by the caller itself instead."""
    monkeypatch.delenv("MINDSPEED_PROXY_SPAWN", raising=False)
    forked = run_distributed(parent_pid, 1)[0]
    spawned = run_distributed(parent_pid, 1, env={"MKL_CBWR": "COMPATIBLE"})[0]
    assert forked != os.getpid() and spawned == os.getpid()


def test_a_first_call_with_another_numeric_env_does_not_start_the_server(monkeypatch):
    """A process whose first launch overrides a numeric setting (the pinned DeepSpeed example's did, in the
    suite) spawns that launch and leaves the server to the next plain launch, which forks from it."""
    from mindspeed_proxy.testing import launcher

    monkeypatch.setattr(launcher, "_ctx", [])  # as in a process that has launched nothing yet
    monkeypatch.delenv("MINDSPEED_PROXY_SPAWN", raising=False)
    other = {"MKL_CBWR": os.environ.get("MKL_CBWR", "") + "X"}
    assert launcher._context(other).get_start_method() == "spawn" and launcher._ctx == []
    assert launcher._context({}).get_start_method() == "forkserver" and len(launcher._ctx) == 1
    assert launcher._context(other).get_start_method() == "spawn"


SCRIPT = """
import os, sys
print("out", sys.argv[1:], os.environ.get("LAUNCHER_TEST_VALUE"), os.getcwd())
print("err line", file=sys.stderr)
sys.stdout.flush()
os.write(1, b"raw fd write\\n")
if sys.argv[1] == "raise":
    raise ValueError("the script raised")
sys.exit({"exit3": 3, "message": "a message", "none": None}[sys.argv[1]])
"""


@pytest.mark.parametrize("how", ["exit3", "message", "none", "raise"])
def test_run_python_gives_what_a_new_interpreter_gives(tmp_path, monkeypatch, how):
    """Same exit code, stdout and stderr as `subprocess.run([sys.executable, ...])`, as a script, -m and -c."""
    import subprocess

    from mindspeed_proxy.testing import run_python

    (tmp_path / "script_under_test.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    env = {"LAUNCHER_TEST_VALUE": "v"}
    for argv in (["script_under_test.py", how], ["-m", "script_under_test", how], ["-c", SCRIPT, how]):
        fresh = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60,
                               env={**os.environ, **env})
        forked = run_python(argv, env=env, timeout=60)
        assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout), argv
        assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1], (forked.stderr, fresh.stderr)
        assert {"exit3": 3, "message": 1, "none": 0, "raise": 1}[how] == forked.returncode
        assert "launcher.py" not in forked.stderr  # the traceback starts at the command's own frames
    assert os.environ.get("LAUNCHER_TEST_VALUE") is None


def save_and_load_torch_dist(folder):
    """A 2-rank torch_dist save of a row-sharded tensor, then its load: what the rank's results queue is,
    which of the rank's child processes are still alive after the save, and the loaded shard."""
    import queue

    import psutil
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    rank = dist.get_rank()
    shard = torch.arange(8, dtype=torch.float32).reshape(2, 4) + 100 * rank
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", shard, (0, rank, 2))}, folder)
    alive = [" ".join(c.cmdline())[:80] for c in psutil.Process().children(recursive=True) if c.is_running()
             and c.status() != psutil.STATUS_ZOMBIE]
    local = isinstance(filesystem_async._results_queue, queue.Queue)
    back = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4), (0, rank, 2))},
                                   folder)["w"]
    return {"local queue": local, "alive": alive, "equal": bool(torch.equal(back, shard))}


def test_ranks_save_torch_dist_without_a_spawned_results_manager(tmp_path):
    """patches/save_results_queue.py in the launcher's ranks: megatron-core's torch_dist writer hands the write
    results over a queue of the rank (no `spawn` Manager interpreter left running beside it), and the checkpoint
    it wrote loads back shard for shard."""
    os.makedirs(tmp_path / "ckpt")
    got = run_distributed(save_and_load_torch_dist, 2, str(tmp_path / "ckpt"))
    assert got == [{"local queue": True, "alive": [], "equal": True}] * 2
