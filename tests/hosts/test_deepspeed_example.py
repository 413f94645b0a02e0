"""examples/deepspeed_moe.py in its quick mode (6 steps per run, 1 GRPO step) so it cannot rot: every phase runs
on 2 gloo ranks under ZeRO-2 (healthy, router fault, the converter on the saved Hugging Face model, the original
and its proxy going on from there, GRPO through the public RL API) and `compare` reads the two runs."""
import json
import os
import sys

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e '.[deepspeed]')")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import deepspeed_moe  # noqa: E402


def _records(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_quick_mode_runs_every_phase(tmp_path, capsys):
    assert deepspeed_moe.main(["--quick", "--steps", "6", "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name, steps in (("healthy", 6), ("router-fault", 6), ("original", 3), ("proxy", 3)):
        metrics = _records(tmp_path / name / "metrics.jsonl")
        losses = [r["loss"] for r in metrics if r["type"] == "step"]
        assert len(losses) == steps and all(0 < x < 10 for x in losses), (name, losses)
        samples = [r for r in _records(tmp_path / name / "mechanism_monitor" / "monitor.jsonl")
                   if r["type"] == "sample" and r["family"] == "router"]
        assert samples and sorted(samples[-1]["layers"]) == ["0", "1"], name
    with open(tmp_path / "proxy-hf" / "config.json", encoding="utf-8") as fh:
        config = json.load(fh)  # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
        assert config.get("num_experts", config.get("num_local_experts")) == 4
    faults = [r for r in _records(tmp_path / "router-fault" / "mechanism_monitor" / "monitor.jsonl")
              if r["type"] == "faults"]
    assert faults and faults[0]["faults"][0]["kind"] == "router-lr"
    rl = [r for r in _records(tmp_path / "healthy" / "mechanism_monitor" / "monitor.jsonl")
          if r["type"] == "sample" and r["family"] == "rl"]
    assert rl, "the GRPO step did not reach the rl family"
    assert "GRPO step 1: reward" in out and "verdict:" in out and "proxy: 4 experts (from 8)" in out
    numerics = _records(tmp_path / "healthy" / "metrics.jsonl")[0]["numerics"]  # the ranks ran on the pins
    assert numerics["env"]["MKL_CBWR"] == "COMPATIBLE" and numerics["cpu_capability"] in ("AVX2", "DEFAULT")
    assert "MKL_CBWR=COMPATIBLE" in out
