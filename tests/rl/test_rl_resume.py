"""The GRPO loop saves the monitor's state (and what else its steps depend on) with its checkpoint, and
`--load DIR --rl-resume` continues the run: the resumed steps and alerts are the uninterrupted run's.

The router-noise fault starts after the resume point, so the uninterrupted run has rl-family alerts to compare.
"""
import json
import shutil
from pathlib import Path

import pytest

from mindspeed_proxy.monitor.state import KEY
from mindspeed_proxy.rl.resume import LOOP, REFERENCE
from mindspeed_proxy.rl.train import main
from mindspeed_proxy.testing import run_distributed, run_python
from test_rl_loop import MODEL

STEPS, MID = 12, 6
# the router family's token sums between its samples are per-rank and not saved: the resume point is a
# multiple of router_interval (and of the spectral interval / δ), as with our trainer (docs/monitor.md)
MONITOR = {"interval": 2, "delta": 2, "router_interval": 3}
ARGS = MODEL + ["--grpo-prompts-per-step", "4", "--grpo-group-size", "4", "--micro-batch-size", "8",
                "--rl-eval-prompts", "0", "--lr", "3e-3", "--min-lr", "3e-3", "--grpo-iterations", "1",
                "--grpo-kl-beta", "0.05", "--expert-model-parallel-size", "2", "--train-iters", str(STEPS),
                "--enable-mechanism-monitor", "--log-interval", "100",
                "--inject-fault", "rollout-router-noise:start=8,std=0.5"]
COMPARED = ("reward_mean", "loss", "grad_norm", "kl_ref", "entropy", "topk_match_mean", "load_drift_mean")


def _records(path, kind):
    return [r for r in map(json.loads, open(path, encoding="utf-8")) if r["type"] == kind]


def _run(root, name, fmt, *extra):
    run = root / name
    (root / "monitor.json").write_text(json.dumps(MONITOR))
    run_distributed(main, 2, ARGS + ["--ckpt-format", fmt, "--mechanism-monitor-config", str(root / "monitor.json"),
                                     "--log-dir", str(run / "logs"), "--mechanism-monitor-output", str(run / "mon"),
                                     *extra], timeout=600)
    return run


def _common(ckpt, iteration):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(ckpt / f"iter_{iteration:07d}"))


def _sharded_keys(ckpt):
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    return sorted(load_sharded_metadata(str(ckpt / f"iter_{STEPS:07d}")))


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_resumed_rl_run_repeats_the_uninterrupted_steps_and_alerts(tmp_path, fmt):
    full = _run(tmp_path, "full", fmt, "--save", str(tmp_path / "full" / "ckpt"), "--save-interval", str(MID))
    expected = [a for a in _records(full / "mon" / "monitor.jsonl", "alert") if a["step"] > MID]
    assert any(a["family"] == "rl" for a in expected), "the fault must raise rl alerts after the resume point"
    ckpt = tmp_path / "resumed" / "ckpt"
    shutil.copytree(full / "ckpt", ckpt, ignore=shutil.ignore_patterns(f"iter_{STEPS:07d}"))
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(MID))
    resumed = _run(tmp_path, "resumed", fmt, "--load", str(ckpt), "--rl-resume", "--save", str(ckpt),
                   "--save-interval", str(MID))

    a = {r["iteration"]: r for r in _records(full / "logs" / "metrics.jsonl", "step")}
    b = {r["iteration"]: r for r in _records(resumed / "logs" / "metrics.jsonl", "step")}
    assert sorted(b) == list(range(MID + 1, STEPS + 1))
    for step in b:  # fp32, rollouts drawn from (seed, step), optimizer / RNG / reference restored: bit-identical
        assert {k: b[step][k] for k in COMPARED} == {k: a[step][k] for k in COMPARED}, step
    assert _records(resumed / "mon" / "monitor.jsonl", "alert") == expected
    if fmt == "torch_dist":
        saved, again = _common(full / "ckpt", STEPS), _common(ckpt, STEPS)
        assert saved[KEY] == again[KEY] and saved[LOOP] == again[LOOP]
        assert saved[LOOP]["step"] == STEPS and saved["checkpoint_parts_per_rank"]["names"] == [REFERENCE]
        # the converter keeps the model only: no loop, monitor or per-rank reference state in the proxy
        proxy = tmp_path / "proxy"
        res = run_python([str(Path(__file__).resolve().parents[2] / "convert_to_proxy.py"), "--load",
                          str(full / "ckpt"), "--save", str(proxy), "--target-num-experts", "4",
                          "--target-expert-parallel-size", "1"], timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        common = _common(proxy, STEPS)
        assert not {KEY, LOOP, "checkpoint_parts_per_rank"} & set(common)
        assert [k for k in _sharded_keys(full / "ckpt") if k.startswith("checkpoint_parts.")] == \
            [f"checkpoint_parts.{REFERENCE}/shard_{r}_2" for r in (0, 1)]  # one per rank in the source
        assert not [k for k in _sharded_keys(proxy) if k.startswith("checkpoint_parts.")]


def test_rl_resume_needs_load(capsys):
    with pytest.raises(SystemExit) as exc:
        main(ARGS + ["--expert-model-parallel-size", "1", "--rl-resume"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "mindspeed_proxy.rl.train: error: --rl-resume: needs --load DIR, the checkpoint of the RL run to continue"]
