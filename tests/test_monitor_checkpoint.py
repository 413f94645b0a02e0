"""The mechanism monitor's state inside our trainer's checkpoints (both formats), and --tensorboard-dir.

Each resume test: the run is faulted (lr-spike) after the resume point, so the uninterrupted run has alerts;
the run resumed from the mid checkpoint must raise exactly those alerts and end with the same detector state.
"""
import json
import shutil

import pytest
import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.monitor.state import KEY, SIDE_FILE
from mindspeed_proxy.testing import run_distributed
from mindspeed_proxy.training.loop import train

STEPS, MID = 16, 8
# qk_gram_reuse 0: the cached QK Gram blocks are not part of the saved state (per-rank tensors); with reuse
# the first samples after a resume recompute them and differ in float rounding (docs/monitor.md)
MONITOR = {"interval": 1, "delta": 1, "router_interval": 2, "sinks": ["jsonl", "tensorboard"], "qk_gram_reuse": 0,
           "detector": {"warmup": 4, "persistence": 1}, "router_detector": {"warmup": 2, "persistence": 1}}
BASE = ["--num-layers", "2", "--log-interval", "4", "--lr-warmup-iters", "2", "--expert-model-parallel-size", "2",
        "--train-iters", str(STEPS), "--enable-mechanism-monitor", "--inject-fault", "lr-spike:start=11,x=40"]


def _alerts(out_dir, after=0):
    records = [json.loads(line) for line in open(out_dir / "monitor.jsonl", encoding="utf-8")]
    return [r for r in records if r["type"] == "alert" and r["step"] > after]


def _run(tmp, name, fmt, *extra):
    run = tmp / name
    (tmp / "monitor.json").write_text(json.dumps(MONITOR))
    run_distributed(train, 2, BASE + ["--ckpt-format", fmt, "--mechanism-monitor-config", str(tmp / "monitor.json"),
                                      "--log-dir", str(run / "logs"), "--mechanism-monitor-output", str(run / "mon"),
                                      *extra], timeout=600)
    return run


def _legacy_files(ckpt, iteration):
    return sorted((ckpt / f"iter_{iteration:07d}").glob("mp_rank_*/model_optim_rng.pt"))


def _saved_state(ckpt, fmt, iteration):
    if fmt == "torch":
        states = [safe_torch_load(str(p))[KEY] for p in _legacy_files(ckpt, iteration)]
        assert len(states) == 2 and states[0] == states[1]  # rank-agnostic: both EP ranks saved the same state
        return states[0]
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(ckpt / f"iter_{iteration:07d}"))[KEY]


def _resume_copy(full, tmp, name):
    ckpt = tmp / name / "ckpt"
    shutil.copytree(full / "ckpt", ckpt, ignore=shutil.ignore_patterns(f"iter_{STEPS:07d}"))
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(MID))
    return ckpt


@pytest.fixture(scope="module", params=["torch", "torch_dist"])
def full(request, tmp_path_factory):
    """The uninterrupted faulted run, saving at MID and at the end, with a TensorBoard writer."""
    tmp = tmp_path_factory.mktemp(f"full_{request.param}")
    run = _run(tmp, "full", request.param, "--save", str(tmp / "full" / "ckpt"), "--save-interval", str(MID),
               "--tensorboard-dir", str(tmp / "full" / "tb"))
    return request.param, tmp, run


def test_resumed_run_raises_the_uninterrupted_alerts(full):
    fmt, tmp, run = full
    expected = _alerts(run / "mon", after=MID)
    assert expected, "the fault must raise alerts after the resume point, or this test shows nothing"
    assert not list((run / "ckpt" / f"iter_{MID:07d}").glob(SIDE_FILE))  # no side file any more
    ckpt = _resume_copy(run, tmp, "resumed")
    resumed = _run(tmp, "resumed", fmt, "--load", str(ckpt), "--save", str(ckpt))
    assert _alerts(resumed / "mon") == expected
    assert _saved_state(ckpt, fmt, STEPS) == _saved_state(run / "ckpt", fmt, STEPS)

    # without the saved state the resumed detectors re-learn their baseline: other alerts (the state mattered)
    bare = _resume_copy(run, tmp, "bare")
    if fmt == "torch":
        for path in _legacy_files(bare, MID):
            state = safe_torch_load(str(path))
            del state[KEY]
            torch.save(state, path)
        relearned = _run(tmp, "bare", fmt, "--load", str(bare))
        assert _alerts(relearned / "mon") != expected


def test_old_side_file_checkpoint_still_loads(full):
    """A checkpoint written before the state moved inside (iter_*/mechanism_monitor_state.json) resumes alike."""
    fmt, tmp, run = full
    if fmt != "torch":
        pytest.skip("the side file is format-independent; the legacy copy is the one whose key can be removed")
    ckpt = _resume_copy(run, tmp, "side")
    state = _saved_state(ckpt, fmt, MID)
    for path in _legacy_files(ckpt, MID):
        saved = safe_torch_load(str(path))
        del saved[KEY]
        torch.save(saved, path)
    (ckpt / f"iter_{MID:07d}" / SIDE_FILE).write_text(json.dumps(state))
    resumed = _run(tmp, "side", fmt, "--load", str(ckpt))
    assert _alerts(resumed / "mon") == _alerts(run / "mon", after=MID)


def test_tensorboard_dir_gets_trainer_and_monitor_tags(full):
    """--tensorboard-dir: the trainer's scalars and the monitor's tags, read back with tensorboard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fmt, _, run = full
    if fmt != "torch":
        pytest.skip("one format is enough: the writer does not depend on the checkpoint format")
    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    metrics = [json.loads(line) for line in open(run / "logs" / "metrics.jsonl", encoding="utf-8")][1:]
    losses = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(losses) == list(range(1, STEPS + 1))
    for record in metrics:  # float32 in the event file
        assert losses[record["iteration"]] == pytest.approx(record["loss"], rel=1e-6)
    samples = [json.loads(line) for line in open(run / "mon" / "monitor.jsonl", encoding="utf-8")]
    router = [r for r in samples if r["type"] == "sample" and r["family"] == "router"]
    assert {"train/loss", "train/lr", "train/grad_norm", "mechanism/router/entropy/layer_0",
            "mechanism/update-spectral/linear_qkv/entropy/layer_0",
            "mechanism/attention-spectral/delta2/entropy/layer_1"} <= tags
    assert "mechanism/alerts/text_summary" in acc.Tags()["tensors"]  # the alerts, as TensorBoard text
    spectral = [e.step for e in acc.Scalars("mechanism/update-spectral/linear_qkv/entropy/layer_0")]
    assert spectral == list(range(1, STEPS + 1))  # interval 1
    entropy = {e.step: e.value for e in acc.Scalars("mechanism/router/entropy/layer_0")}
    assert sorted(entropy) == [r["step"] for r in router]
    for r in router:
        assert entropy[r["step"]] == pytest.approx(r["layers"]["0"]["entropy"], rel=1e-6)


def test_a_newer_state_layout_is_refused_with_one_line():
    """A saved state of a layout this code does not know is refused, naming where it came from; none is a no-op."""
    from mindspeed_proxy.monitor.state import MonitorPart, StateVersionError

    class Monitor:
        loaded = None

        def load_state_dict(self, state):
            self.loaded = state

    part = MonitorPart(Monitor())
    with pytest.raises(StateVersionError) as info:
        part.load_state_dict({"version": 2}, where="ckpt/iter_0000008")
    assert str(info.value) == ("ckpt/iter_0000008: mechanism monitor state version 2 is not supported "
                               "(this mindspeed-proxy reads versions 1..1)")
    assert isinstance(info.value, ValueError) and part.monitor.loaded is None  # the trainer's exit-2 path
    part.load_state_dict(None)
    assert part.monitor.loaded is None and part.restored_from is None
    part.load_state_dict({"version": 1, "disabled": []}, where="x")
    assert part.monitor.loaded == {"version": 1, "disabled": []} and part.restored_from == "x"


def test_a_resume_inside_a_router_window_records_that_window_untested(tmp_path):
    """The router window's token sums are not in the checkpoint (per rank, not yet reduced): resumed from step 5 with
    router_interval 2, the sample at step 6 covers one step. It is written with `window_steps` 1 and not tested, so
    the router detectors saved at step 10 have seen one sample fewer than the uninterrupted run's."""
    full = _run(tmp_path, "odd", "torch", "--save", str(tmp_path / "odd" / "ckpt"), "--save-interval", "5")
    ckpt = tmp_path / "odd_resumed" / "ckpt"
    shutil.copytree(full / "ckpt", ckpt, ignore=shutil.ignore_patterns("iter_00000[1-9][0-9]", "iter_000001[0-9]"))
    (ckpt / "latest_checkpointed_iteration.txt").write_text("5")
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000005"]
    resumed = _run(tmp_path, "odd_resumed", "torch", "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "5")

    def router_samples(run):
        records = [json.loads(line) for line in open(run / "mon" / "monitor.jsonl", encoding="utf-8")]
        return {r["step"]: r for r in records if r["type"] == "sample" and r["family"] == "router"}

    after = router_samples(resumed)
    assert sorted(after) == list(range(6, STEPS + 1, 2))
    assert after[6]["window_steps"] == 1 and all("window_steps" not in r for s, r in after.items() if s != 6)
    assert all("window_steps" not in r for r in router_samples(full).values())

    def seen(run_ckpt):
        state = _saved_state(run_ckpt, "torch", 10)["router_detectors"]["detectors"]
        return {tuple(key): det["samples"] for key, det in state}

    uninterrupted, resumed_seen = seen(full / "ckpt"), seen(ckpt)
    assert uninterrupted and set(resumed_seen) == set(uninterrupted)
    assert all(resumed_seen[k] == n - 1 for k, n in uninterrupted.items())
