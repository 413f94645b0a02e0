"""The demo's warm-up run twice gives bit-identical numbers (docs/determinism.md).

Same code path and settings as `make demo`'s first stage (`Matrix.warmup` with
examples/configs/fault_matrix.yaml: trainer flags, 2 gloo ranks at EP=2, the config's pinned `env`), shortened
to a few steps so that the suite stays fast.
"""
import json
from pathlib import Path

import pytest
import torch

from mindspeed_proxy.checkpoint_io import safe_torch_load
from mindspeed_proxy.experiments import Matrix, Progress, load_config

REPO = Path(__file__).resolve().parents[1]
STEPS = 12  # the smallest warm-up past its 10 LR warm-up steps (the trainer refuses fewer)


def _records(work: Path) -> list[dict]:
    return [json.loads(line) for line in open(work / "warmup" / "logs" / "metrics.jsonl", encoding="utf-8")]


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


def test_demo_warmup_twice_gives_bit_identical_losses_and_weights(tmp_path):
    cfg = load_config(REPO / "examples" / "configs" / "fault_matrix.yaml", "quick")
    pinned = cfg["env"]["ATEN_CPU_CAPABILITY"].lower()
    if pinned != "default" and pinned not in _cpu_flags():
        pytest.skip(f"the config pins ATEN_CPU_CAPABILITY={pinned}, which this CPU lacks (torch falls back to "
                    "another kernel set, so the pinned-capability assertion cannot hold here)")
    cfg["warmup"] = {**cfg["warmup"], "iters": STEPS}
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
