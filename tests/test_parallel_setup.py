"""mindspeed_proxy.parallel on real megatron-core (gloo, several ranks): set up, reuse an identical layout, refuse a
different one without touching it, tear down only what it set up; the trainer on top of it."""
import contextlib
import io

import pytest

from mindspeed_proxy.testing import run_distributed

RUN = ["--num-layers", "2", "--train-iters", "2", "--lr-warmup-iters", "1", "--global-batch-size", "8",
       "--micro-batch-size", "2", "--log-interval", "1"]


def _groups():
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_group(), ps.get_expert_model_parallel_group(),
            ps.get_data_parallel_group())


def _tracker_states():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}


def _setup_reuse_refuse_teardown():
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mindspeed_proxy.parallel import Layout, ParallelSetupError, current_layout, setup

    out = {"before": current_layout()}
    mine = setup(tp=2, ep=2, seed=7)
    out["owned"], out["layout"] = mine.owned, current_layout()
    out["draw"], out["tracker"] = torch.rand(3), _tracker_states()
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    torch.manual_seed(7)
    out["draw_ref"], out["tracker_ref"] = torch.rand(3), _tracker_states()
    groups = _groups()

    again = setup(tp=2, ep=2)  # identical layout: reused, not rebuilt
    out["reused_owned"], out["reused_same_groups"] = again.owned, _groups() == groups
    again.teardown()  # not ours: stays
    out["after_reuse_teardown"] = ps.model_parallel_is_initialized() and _groups() == groups

    try:
        setup(tp=1, ep=4, seed=1)
        out["refused"] = None
    except ParallelSetupError as exc:
        out["refused"] = str(exc)
    out["after_refusal"] = ps.model_parallel_is_initialized() and _groups() == groups \
        and current_layout() == Layout(2, 1, 2, 1, None, 2)

    mine.teardown()
    out["after_teardown"] = ps.model_parallel_is_initialized()
    mine.teardown()  # idempotent
    out["fresh"] = setup(tp=1, ep=4).owned and current_layout() == Layout(1, 1, 4, 1, None, 1)
    return out


def test_setup_reuses_refuses_and_tears_down_only_its_own():
    results = run_distributed(_setup_reuse_refuse_teardown, 4, timeout=240)
    for rank, r in enumerate(results):
        assert r["before"] is None and r["owned"] is True, rank
        assert str(r["layout"]) == "TP=2 PP=1 EP=2 CP=1 ETP=2", rank
        assert r["reused_owned"] is False and r["reused_same_groups"] and r["after_reuse_teardown"], rank
        assert r["refused"] is not None and "\n" not in r["refused"], rank
        assert "TP=2 PP=1 EP=2" in r["refused"] and "TP=1 PP=1 EP=4" in r["refused"], rank
        assert r["after_refusal"] and r["after_teardown"] is False and r["fresh"], rank
        # seeded exactly as megatron-core's own recipe: torch's stream and the per-rank tracker streams
        assert r["draw"].equal(r["draw_ref"]), rank
        assert sorted(r["tracker"]) == sorted(r["tracker_ref"]) and r["tracker"], rank
        assert all(r["tracker"][k].equal(r["tracker_ref"][k]) for k in r["tracker"]), rank
    # the TP streams differ between TP ranks (megatron offsets the seed by the TP rank)
    key = "model-parallel-rng"
    assert not results[0]["tracker"][key].equal(results[1]["tracker"][key])


def _train_under(caller_tp, tmp):
    """The trainer (TP=1, EP=2) inside a caller that already initialised parallel_state with TP=1 EP=2 or TP=2 EP=1
    (caller_tp), or nothing (None): exit code, stderr, and whether the caller's groups are the same objects after."""
    from megatron.core import parallel_state as ps

    from mindspeed_proxy.training.loop import train

    if caller_tp is not None:
        ps.initialize_model_parallel(tensor_model_parallel_size=caller_tp, expert_model_parallel_size=3 - caller_tp)
    groups = _groups() if caller_tp is not None else None
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = train(RUN + ["--expert-model-parallel-size", "2", "--log-dir", tmp])
        except SystemExit as exc:
            code = exc.code
    alive = ps.model_parallel_is_initialized()
    return {"code": code, "stderr": err.getvalue(), "alive": alive,
            "same_groups": alive and groups is not None and _groups() == groups}


@pytest.mark.parametrize("caller_tp", [None, 1, 2])
def test_trainer_owns_only_the_parallel_state_it_set_up(tmp_path, caller_tp):
    results = run_distributed(_train_under, 2, caller_tp, str(tmp_path), timeout=300)
    for r in results:
        if caller_tp is None:  # the trainer set it up, so it tears it down
            assert r["code"] == 0 and r["alive"] is False, r
        elif caller_tp == 1:  # the caller's identical layout: reused, left in place
            assert r["code"] == 0 and r["alive"] and r["same_groups"], r
        else:  # another layout: refused in one line, the caller's groups untouched
            assert r["code"] == 2 and r["alive"] and r["same_groups"], r
            lines = [l for l in r["stderr"].splitlines() if l.strip()]
            assert len(lines) == 1 and "error:" in lines[0] and "already initialised" in lines[0], r["stderr"]
