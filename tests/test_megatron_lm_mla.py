"""Multi-latent attention through Megatron-LM's own `pretrain_gpt.py` on CPU, with the monitor's MLA QK forms.

`--multi-latent-attention` with Megatron-LM's local spec used to die while building the model (its default YaRN
rope: no accelerator for `torch.device(current_device())`; `--rope-type rope`: the local DotProductAttention takes
no `k_channels`); patches/mla_local.py answers both. Two runs (EP=2, 2 gloo ranks, 4 steps, monitor every 2 steps
with delta 2, saved at steps 2 and 4): YaRN saved as legacy files, RoPE as torch_dist. The monitor's step-4 QK
sample (content form `delta2` and RoPE form `rope_delta2`, every head of both layers) is compared with a float64
recomputation from the run's own checkpoints at steps 2 and 4: the dense d×d Δ2 of M = Wqᵀ Wk per head, its
singular values and their statistics. Needs MEGATRON_LM_PATH (see tests/test_megatron_lm.py); skips otherwise.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from test_megatron_lm import MLM, MODEL_FLAGS, _losses, env, mlm  # noqa: F401  (fixtures)
from test_megatron_lm_convert import _ok, pretrain

pytestmark = pytest.mark.skipif(
    not MLM,
    reason="MEGATRON_LM_PATH is not set: these tests need a Megatron-LM checkout (core_v0.16 line), "
           "which CI does not have",
)

D, HEADS, QK, ROPE, V, Q_LORA, KV_LORA, LAYERS = 64, 4, 16, 8, 16, 32, 16, 2
MLA_FLAGS = ["--multi-latent-attention", "--q-lora-rank", str(Q_LORA), "--kv-lora-rank", str(KV_LORA),
             "--qk-head-dim", str(QK), "--qk-pos-emb-head-dim", str(ROPE), "--v-head-dim", str(V),
             "--train-iters", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--enable-mechanism-monitor", "--mechanism-monitor-interval", "2", "--mechanism-monitor-delta", "2",
             "--save-interval", "2"]
GQA = ["--group-query-attention", "--num-query-groups", "2"]
# MODEL_FLAGS less its GQA: Megatron-LM refuses GQA with MLA (whose keys are per head, from one shared latent)
MLA_BASE = [f for i, f in enumerate(MODEL_FLAGS) if f not in GQA[:2] and not (i and MODEL_FLAGS[i - 1] == GQA[1])]
# YaRN with the latent norms (--qk-layernorm, as DeepSeek-V3 has them) as legacy files; RoPE without them, torch_dist
CASES = {"yarn_torch": ("torch", ["--qk-layernorm"]), "rope_torch_dist": ("torch_dist", ["--rope-type", "rope"])}
STATS = ("entropy", "normalized_entropy", "effective_rank", "stable_rank", "top1_energy", "frobenius")


@pytest.fixture(scope="module")
def runs(mlm, env, tmp_path_factory):
    """runs(case) -> (process, checkpoint folder, monitor records), each run once."""
    done: dict = {}

    def run(case: str):
        if case not in done:
            fmt, extra = CASES[case]
            cwd = tmp_path_factory.mktemp(case)
            res = pretrain(mlm, env, cwd, 2, MLA_BASE + MLA_FLAGS + extra + [
                "--ckpt-format", fmt, "--save", str(cwd / "ckpt"), "--mechanism-monitor-output", str(cwd / "mon")])
            records = []
            if (cwd / "mon" / "monitor.jsonl").is_file():
                records = [json.loads(line) for line in (cwd / "mon" / "monitor.jsonl").read_text().splitlines()]
            done[case] = (res, cwd / "ckpt", records)
        return done[case]
    return run


def attention_weights(ckpt: Path, fmt: str, iteration: int) -> dict:
    """{layer: {name: float64 tensor}} of the MLA projections and the latent norms (where present) a checkpoint
    holds."""
    names = ("linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight",
             "linear_kv_down_proj.weight", "kv_layernorm.weight", "linear_kv_up_proj.weight")
    folder = ckpt / f"iter_{iteration:07d}"
    if fmt == "torch":  # TP=1: attention is replicated over the EP ranks, rank (0, 0) holds it
        from mindspeed_proxy.checkpoint_io import safe_torch_load

        model = safe_torch_load(str(folder / "mp_rank_00_000" / "model_optim_rng.pt"))["model"]
        return {i: {n: model[f"decoder.layers.{i}.self_attention.{n}"].double() for n in names
                    if f"decoder.layers.{i}.self_attention.{n}" in model} for i in range(LAYERS)}
    from torch.distributed.checkpoint import FileSystemReader, load

    reader = FileSystemReader(str(folder))
    meta = reader.read_metadata().state_dict_metadata
    keys = {}  # (layer, name) -> (key, index in a stacked [L, ...] tensor or None)
    for i in range(LAYERS):
        for n in names:
            per_layer, stacked = f"decoder.layers.{i}.self_attention.{n}", f"decoder.layers.self_attention.{n}"
            if per_layer in meta or stacked in meta:
                keys[i, n] = (per_layer, None) if per_layer in meta else (stacked, i)
    wanted = {key for key, _ in keys.values()}
    state = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in wanted}
    load(state, storage_reader=reader, no_dist=True)
    return {i: {n: (state[k] if at is None else state[k][at]).double() for (j, n), (k, at) in keys.items() if j == i}
            for i in range(LAYERS)}


def head_factors(w: dict) -> dict:
    """{part: (Wq [heads, k, d], Wk [heads | 1, k, d])}: the per-head q/k maps of the content and RoPE scores."""
    q = (w["linear_q_up_proj.weight"] * w.get("q_layernorm.weight", 1.0)) @ w["linear_q_down_proj.weight"]
    q = q.view(HEADS, QK + ROPE, D)
    kv_down = w["linear_kv_down_proj.weight"]
    k = (w["linear_kv_up_proj.weight"] * w.get("kv_layernorm.weight", 1.0)) @ kv_down[:KV_LORA]
    k = k.view(HEADS, QK + V, D)[:, :QK]
    return {"delta2": (q[:, :QK], k), "rope_delta2": (q[:, QK:], kv_down[KV_LORA:].unsqueeze(0))}


def reference_stats(old: dict, new: dict) -> dict:
    """{part: [per-head stats]} of the dense float64 Δ2 = ΔWqᵀ Wk + Wqᵀ ΔWk (d×d) of M = Wqᵀ Wk."""
    out = {}
    for part in ("delta2", "rope_delta2"):
        (q0, k0), (q1, k1) = head_factors(old)[part], head_factors(new)[part]
        delta2 = (q1 - q0).mT @ k0 + q0.mT @ (k1 - k0)
        out[part] = []
        n = 2 * q0.shape[-2]  # Δ2 of k-column factors: 2k singular values
        for s in torch.linalg.svdvals(delta2.expand(HEADS, D, D)):
            # the numerical rank the monitor's statistics are defined with: σ above the noise floor of its float32
            # Gram route, √(max(n, d)·eps)·σ_max (monitor/spectral_routes.py), written out here; the energies
            # (stable rank, top-1 energy, Frobenius norm) are over all values
            kept = s[s > math.sqrt(max(n, D) * torch.finfo(torch.float32).eps) * s.max()]
            p = kept.square() / kept.square().sum()
            h = float(-(p * p.log()).sum())
            energy = s.square().sum()
            out[part].append({"entropy": h, "normalized_entropy": h / math.log(len(kept)),
                              "effective_rank": math.exp(h), "stable_rank": float(energy / s[0] ** 2),
                              "top1_energy": float(s[0] ** 2 / energy), "frobenius": float(energy.sqrt())})
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_mla_trains_saves_and_samples_its_qk_forms(runs, case):
    """MLA (YaRN or RoPE) trains 4 steps at EP=2, saves at 2 and 4, and the monitor samples both MLA QK forms."""
    res, ckpt, records = runs(case)
    losses = _losses(_ok(res))
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(float(v)) for v in losses.values()), losses
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (ckpt / "iter_0000002").is_dir() and (ckpt / "iter_0000004").is_dir()
    attention = [r for r in records if r.get("family") == "attention-spectral"]
    assert [r["step"] for r in attention] == [2, 4]
    for rec in attention:
        assert set(rec["layers"]) == {"0", "1"}
        for layer in rec["layers"].values():
            assert set(layer) == {"delta2", "rope_delta2"}
            assert all(set(form["heads"]) == {"0", "1", "2", "3"} for form in layer.values())
    assert "disabled after an exception" not in res.stdout + res.stderr


@pytest.mark.parametrize("case", sorted(CASES))
def test_mla_qk_monitor_matches_float64_from_the_checkpoints(runs, case):
    """The monitor's step-4 Δ2 statistics (its compressed float32 path) equal a dense float64 SVD of the
    per-head Δ2 recomputed from the weights the run saved at steps 2 and 4, the rank counted above the floor of
    the monitor's Gram route (measured: 2.1e-7 YaRN, 3.1e-7 RoPE; docs/megatron_lm.md, Multi-latent attention)."""
    res, ckpt, records = runs(case)
    _ok(res)
    fmt = CASES[case][0]
    old, new = attention_weights(ckpt, fmt, 2), attention_weights(ckpt, fmt, 4)
    sample = next(r for r in records if r.get("family") == "attention-spectral" and r["step"] == 4)
    worst = 0.0
    for layer in range(LAYERS):
        ref = reference_stats(old[layer], new[layer])
        for part, heads in ref.items():
            got = sample["layers"][str(layer)][part]["heads"]
            for head, stats in enumerate(heads):
                for stat in STATS:
                    err = abs(got[str(head)][stat] - stats[stat]) / abs(stats[stat])
                    worst = max(worst, err)
                    assert err <= 1e-5, (case, layer, part, head, stat, got[str(head)][stat], stats[stat])
    print(f"{case}: worst relative difference monitor vs float64 {worst:.2e}")
