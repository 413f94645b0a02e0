"""The demo's warm-up, into the first steps of its fault, run twice gives bit-identical numbers (docs/determinism.md).

Same code path and settings as `make demo` (`Matrix.warmup` with examples/configs/fault_matrix.yaml: trainer flags,
2 gloo ranks at EP=2, the config's pinned `env`), shortened to a few steps so that the suite stays fast, with the
demo's fault (`lowp-attention`, its rounding kernels) and the mechanism monitor (its SVDs) switched on from a step
inside the same run: one launch per copy covers the healthy steps, the faulted ones and the monitor.
"""
import json
import re
from pathlib import Path

import pytest
import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.experiments import Matrix, Progress, load_config

REPO = Path(__file__).resolve().parents[1]
STEPS = 12  # the smallest warm-up past its 10 LR warm-up steps (the trainer refuses fewer)
FAULT_START = 6  # the demo's fault from this step: 7 faulted steps, and the spectral sample of step 10 sees them


def _records(work: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in open(work / "warmup" / "logs" / name, encoding="utf-8")]


def _weights(work: Path) -> dict:
    out = {}
    for path in sorted((work / "warmup" / "ckpt").rglob("*.pt")):
        state = safe_torch_load(str(path))["model"]
        out.update({f"{path.parent.name}/{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            return next((set(line.split(":", 1)[1].split()) for line in fh if line.startswith("flags")), set())
    except OSError:
        return set()


def test_demo_warmup_and_first_faulted_steps_twice_give_bit_identical_numbers(tmp_path):
    cfg = load_config(REPO / "examples" / "configs" / "fault_matrix.yaml", "quick")
    pinned = cfg["env"]["ATEN_CPU_CAPABILITY"].lower()
    if pinned != "default" and pinned not in _cpu_flags():
        pytest.skip(f"the config pins ATEN_CPU_CAPABILITY={pinned}, which this CPU lacks (torch falls back to "
                    "another kernel set, so the pinned-capability assertion cannot hold here)")
    spec = re.sub(r"start=\d+", f"start={FAULT_START}", cfg["faults"]["lowp-attention"])
    assert f"start={FAULT_START}" in spec
    cfg["warmup"] = {**cfg["warmup"], "iters": STEPS,
                     "args": [*cfg["warmup"].get("args", []), "--inject-fault", spec, "--enable-mechanism-monitor",
                              "--mechanism-monitor-config", cfg["monitor_config"]]}
    works = [tmp_path / "a", tmp_path / "b"]
    for work in works:
        Matrix(cfg, work, REPO, Progress(quiet=True)).warmup()
    runs = [_records(w) for w in works]
    losses = [[(r["loss"], r["grad_norm"]) for r in recs if r["type"] == "step"] for recs in runs]
    assert len(losses[0]) == STEPS
    assert [(x.hex(), g.hex()) for x, g in losses[0]] == [(x.hex(), g.hex()) for x, g in losses[1]]
    numerics = runs[0][0]["numerics"]  # the args record: the ranks ran under the pinned env
    assert numerics["threads"] == 1 and numerics["env"]["MKL_CBWR"] == cfg["env"]["MKL_CBWR"]
    assert numerics["cpu_capability"] == cfg["env"]["ATEN_CPU_CAPABILITY"].upper()
    monitors = [_records(w, "mechanism_monitor/monitor.jsonl") for w in works]
    faults = next(r["faults"] for r in monitors[0] if r["type"] == "faults")
    assert [(f["name"], f["start"]) for f in faults] == [("lowp-attention", FAULT_START)]
    samples = [[r for r in recs if r["type"] == "sample"] for recs in monitors]
    spectral_after = {r["family"] for r in samples[0] if r["step"] > FAULT_START and r["family"].endswith("spectral")}
    assert spectral_after == {"attention-spectral", "update-spectral"}
    assert json.dumps(samples[0]) == json.dumps(samples[1])  # every statistic of every sample, bit for bit
    a, b = (_weights(w) for w in works)
    assert a.keys() == b.keys() and len(a) > 10
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_every_launcher_pins_the_same_numerics():
    """The fault matrix's `env`, the RL demo and the RL matrix launch with determinism.PINNED_ENV, one source."""
    from mindspeed_proxy.determinism import NUMERIC_ENV, PINNED_ENV

    cfg = load_config(str(REPO / "examples" / "configs" / "fault_matrix.yaml"))
    assert cfg["env"] == PINNED_ENV
    assert set(PINNED_ENV) <= set(NUMERIC_ENV)
    for path in ("examples/rl_demo.py", "mindspeed_proxy/experiments/rl_matrix.py"):
        assert "PINNED_ENV" in (REPO / path).read_text(encoding="utf-8"), path
