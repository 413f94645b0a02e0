"""examples/megatron_rl_faults.py, short: the whole pipeline (preprocess_data.py, pretrain_gpt.py SFT,
convert_to_proxy.py, train_rl.py) with `rollout-router-noise` on the proxy (1 rank), without and with R3, and on the
original (2 ranks, EP=2) with R3, for a few iterations. On 2 ranks the second engine serves its requests inside
`megatron_rl_inference_mode`'s exit: before the rows' rollout phase spanned it, no rollout of rank 1 was recorded
and R3 left passes unreplayed under this fault (docs/megatron_lm.md, section "Faults inside train_rl.py").

Checks the pipeline's structure, not the table's verdicts (too few iterations for the detectors' warm-up): the
noise acts from its onset in the rollout passes only, so the rl family's any-layer expert mismatch between the
rollout and the training pass on the same tokens is large from the onset without R3 and exactly 0 with R3 (the
training passes replay the rollout's experts); every iteration has its pickled rollouts and a reward.
Needs a Megatron-LM checkout (MEGATRON_LM_PATH) and the `rl` extra; skips otherwise (not in CI).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_megatron_lm import env, mlm, pytestmark  # noqa: F401  (fixtures, skip reason)
from test_megatron_lm_rl import rl_env  # noqa: F401  (fixture: skips without the rl extra)

REPO = Path(__file__).resolve().parents[1]
ITERS, ONSET = 4, 3


def test_rollout_noise_mismatch_without_r3_and_none_with_r3(mlm, rl_env, tmp_path):
    """Without R3 the expert mismatch is >= 0.05 at every faulted iteration and above every earlier one; with R3
    it is 0 at every iteration, on 1 and on 2 ranks, with every training pass replayed (no R3 warning)."""
    work = tmp_path / "work"
    cmd = [sys.executable, str(REPO / "examples" / "megatron_rl_faults.py"), "--work-dir", str(work),
           "--megatron-lm", str(mlm), "--runs", "noise-proxy,noise-proxy-r3,noise-original-r3", "--sft-iters", "30",
           "--sft-docs", "400", "--rl-iters", str(ITERS), "--onset", str(ONSET), "--noise-std", "2.0"]
    res = subprocess.run(cmd, env=rl_env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "| noise-proxy | proxy (1) | rollout-router-noise:start=3,std=2.0,seed=1234 | off |" in res.stdout
    assert (work / "table.md").read_text().strip() in res.stdout
    results = json.loads((work / "results.json").read_text())
    for name in ("noise-proxy", "noise-proxy-r3", "noise-original-r3"):
        mismatch = {}
        for line in (work / name / "monitor" / "monitor.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("type") == "sample" and rec["family"] == "rl":
                mismatch[rec["step"]] = rec["layers"]["all"]["any_layer_mismatch"]
        assert sorted(mismatch) == list(range(1, ITERS + 1)), mismatch
        assert results[name]["iterations"] == ITERS and results[name]["reward_end"] is not None
        if name.endswith("r3"):
            assert all(v == 0.0 for v in mismatch.values()), mismatch
            assert "match no rollout the engine ran" not in (work / name / "train_rl.log").read_text()
            assert results[name]["mismatch_after_max"] == 0.0
        else:
            faulted = [mismatch[s] for s in range(ONSET, ITERS + 1)]
            assert min(faulted) >= 0.05 and max(mismatch[s] for s in range(1, ONSET)) < min(faulted), mismatch
