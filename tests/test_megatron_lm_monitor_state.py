"""Megatron-LM's own `pretrain_gpt.py` (through `mindspeed_proxy.run`): the monitor's state inside Megatron-LM's
save_checkpoint / load_checkpoint (patches/monitor_checkpoint.py), and Megatron-LM's TensorBoard writer.

Needs MEGATRON_LM_PATH (a core_v0.16 checkout; see tests/test_megatron_lm.py and docs/megatron_lm.md); skips
with that reason without it. The run is faulted (lr-spike) after the resume point, so the uninterrupted run
has alerts; the resumed run must raise exactly those and save the same monitor state at the end.
"""
from __future__ import annotations

import json
import shutil

import pytest

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.monitor.state import KEY
from test_megatron_lm import _launch, _losses, env, mlm, pytestmark  # noqa: F401  (fixtures, skip reason)

STEPS, MID = 20, 10
# without dropout: a run resumed from a checkpoint repeats the uninterrupted one exactly (with Megatron-LM's default
# dropout 0.1 its CPU resume here did not: the first resumed step's ΔW already differed; see docs/megatron_lm.md)
NO_DROPOUT = ("--attention-dropout", "0", "--hidden-dropout", "0")
MONITOR = {"interval": 1, "delta": 1, "router_interval": 2, "sinks": ["jsonl", "tensorboard"], "qk_gram_reuse": 0,
           "detector": {"warmup": 4, "persistence": 1}, "router_detector": {"warmup": 2, "persistence": 1}}


def _run(mlm, env, tmp, name, fmt, *extra):
    (tmp / "monitor.json").write_text(json.dumps(MONITOR))
    run = tmp / name
    run.mkdir(exist_ok=True)
    res = _launch(mlm, env, run, "--train-iters", str(STEPS), *NO_DROPOUT, "--ckpt-format", fmt,
                  "--enable-mechanism-monitor",
                  "--mechanism-monitor-config", str(tmp / "monitor.json"), "--mechanism-monitor-output",
                  str(run / "mon"), "--inject-fault", "lr-spike:start=13,x=40", *extra)
    assert res.returncode == 0, res.stderr[-4000:]
    return run, res


def _alerts(out_dir, after=0):
    records = [json.loads(line) for line in open(out_dir / "monitor.jsonl", encoding="utf-8")]
    return [r for r in records if r["type"] == "alert" and r["step"] > after]


def _samples(out_dir):
    records = [json.loads(line) for line in open(out_dir / "monitor.jsonl", encoding="utf-8")]
    return {(r["family"], r["step"]): r for r in records if r["type"] == "sample"}


def _saved_state(ckpt, fmt, iteration):
    folder = ckpt / f"iter_{iteration:07d}"
    if fmt == "torch":
        states = [safe_torch_load(str(p))[KEY] for p in sorted(folder.glob("mp_rank_*/model_optim_rng.pt"))]
        assert len(states) == 2 and states[0] == states[1]  # both EP ranks saved the same (rank-agnostic) state
        return states[0]
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(folder))[KEY]


@pytest.fixture(scope="module", params=["torch", "torch_dist"])
def full(request, mlm, env, tmp_path_factory):
    """The uninterrupted faulted run, saving at MID and at the end, with Megatron-LM's --tensorboard-dir."""
    tmp = tmp_path_factory.mktemp(f"mlm_{request.param}")
    run, res = _run(mlm, env, tmp, "full", request.param, "--save", str(tmp / "full" / "ckpt"),
                    "--save-interval", str(MID), "--tensorboard-dir", str(tmp / "full" / "tb"))
    return request.param, tmp, run


def test_resumed_pretrain_gpt_raises_the_uninterrupted_alerts(mlm, env, full):
    fmt, tmp, run = full
    expected = _alerts(run / "mon", after=MID)
    assert expected, "the fault must raise alerts after the resume point, or this test shows nothing"
    ckpt = tmp / "resumed" / "ckpt"
    shutil.copytree(run / "ckpt", ckpt, ignore=shutil.ignore_patterns(f"iter_{STEPS:07d}"))
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(MID))
    resumed, res = _run(mlm, env, tmp, "resumed", fmt, "--load", str(ckpt), "--save", str(ckpt),
                        "--save-interval", str(MID))
    assert sorted(_losses(res.stdout)) == list(range(MID + 1, STEPS + 1))  # Megatron-LM resumed at MID
    # the same training after it: every ΔW / QK / router sample of the resumed steps is the uninterrupted run's
    assert _samples(resumed / "mon") == {k: v for k, v in _samples(run / "mon").items() if k[1] > MID}
    assert _alerts(resumed / "mon") == expected
    assert _saved_state(ckpt, fmt, STEPS) == _saved_state(run / "ckpt", fmt, STEPS)


def test_monitor_takes_megatron_lm_tensorboard_writer(full):
    """Megatron-LM's --tensorboard-dir writer (global_vars, last rank) carries Megatron's and the monitor's tags."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fmt, _, run = full
    if fmt != "torch":
        pytest.skip("one format is enough: the writer does not depend on the checkpoint format")
    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert "lm loss" in tags  # Megatron-LM's own scalar: this is its writer
    records = [json.loads(line) for line in open(run / "mon" / "monitor.jsonl", encoding="utf-8")]
    router = [r for r in records if r["type"] == "sample" and r["family"] == "router"]
    entropy = {e.step: e.value for e in acc.Scalars("mechanism/router/entropy/layer_0")}
    assert sorted(entropy) == [r["step"] for r in router] and router
    for r in router:
        assert entropy[r["step"]] == pytest.approx(r["layers"]["0"]["entropy"], rel=1e-6)
    assert "mechanism/update-spectral/linear_qkv/entropy/layer_1" in tags
