"""MLA QK forms on real megatron-core `MLASelfAttention`: the derivation reproduces megatron's q·k, and the
monitor's compressed Δ1/Δ2/Δ3 spectra match a float64 dense SVD of the full per-head Wq_effᵀWk_eff (TP=1, 2)."""
import torch

from mindspeed_proxy.testing import run_distributed

D, HEADS, QK, ROPE, V, KV_LORA = 64, 4, 16, 8, 16, 24
TERMS = ["delta1", "delta2", "delta3"]


def _gather_rows(w):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return w
    parts = [torch.empty_like(w) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, w.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts)


def _effective(attn, q_lora, centered):
    """float64 per-head operators from the module weights: {part: (Wq [n_local, k, d], Wk [n_local|1, k, d])}."""
    f = {n: p.detach().double() for n, p in attn.named_parameters()}
    n_local = f["linear_kv_up_proj.weight"].shape[0] // (QK + V)

    def norm_fold(down, scale_key):
        down = down - down.mean(0, keepdim=True) if centered else down
        return f[scale_key].view(-1, 1) * down

    if q_lora is None:
        q = f["linear_q_proj.weight"].view(n_local, QK + ROPE, D)
    else:
        q_down = norm_fold(_gather_rows(f["linear_q_down_proj.weight"]), "q_layernorm.weight")
        q = f["linear_q_up_proj.weight"].view(n_local, QK + ROPE, q_lora) @ q_down
    kv_down = _gather_rows(f["linear_kv_down_proj.weight"])
    k_c = f["linear_kv_up_proj.weight"].view(n_local, QK + V, KV_LORA)[:, :QK] @ norm_fold(
        kv_down[:KV_LORA], "kv_layernorm.weight")
    return {"content": (q[:, :QK], k_c), "rope": (q[:, QK:], kv_down[KV_LORA:].unsqueeze(0))}, kv_down


def _read_full(readers, attn):
    """mla_read with the TP-sharded down projections all-gathered (cloned)."""
    from mindspeed_proxy.monitor.mla_layout import TP_GATHERED, mla_read

    out = {k: v.detach().clone() for k, v in mla_read(readers, attn).items()}
    return {k: _gather_rows(v) if k in TP_GATHERED else v for k, v in out.items()}


def _gain(c, norm):
    if getattr(norm, "normalization", "RMSNorm") == "LayerNorm":
        return (c.var(-1, unbiased=False, keepdim=True) + norm.eps).rsqrt()
    return (c.square().mean(-1, keepdim=True) + norm.eps).rsqrt()


def _reference_sigma(old, new, term):
    """Dense float64 singular values of the d×d increment of M = Wqᵀ Wk per head (top 2k, or k for delta3)."""
    (q0, k0), (q1, k1) = old, new
    dq, dk = q1 - q0, k1 - k0
    mat = {"delta1": q1.mT @ k1 - q0.mT @ k0, "delta2": dq.mT @ k0 + q0.mT @ dk, "delta3": dq.mT @ dk}[term]
    k = q0.shape[-2]
    return torch.linalg.svdvals(mat)[..., : k if term == "delta3" else 2 * k]


def mla_check(tp, q_lora, normalization):
    """On this rank: forward-derivation error, spectra error (monitor path, float32 and float64) and monitor stats."""
    from megatron.core import parallel_state as ps

    from mindspeed_proxy.layout_init import global_init
    from mindspeed_proxy.monitor import MechanismMonitor, MonitorConfig
    from mindspeed_proxy.monitor.mla_layout import (mla_increment_singular_values, mla_layout_of, mla_qk_blocks,
                                                     mla_weights)
    from mindspeed_proxy.monitor.spectral import spectral_stats
    from mindspeed_proxy.testing.parallel import init_parallel
    from mindspeed_proxy.tiny_moe import TinyMoEConfig, build_model

    init_parallel(tp=tp)
    cfg = TinyMoEConfig(num_layers=1, num_experts=0, hidden_size=D, num_attention_heads=HEADS,
                        multi_latent_attention=True, q_lora_rank=q_lora, kv_lora_rank=KV_LORA, qk_head_dim=QK,
                        qk_pos_emb_head_dim=ROPE, v_head_dim=V, qk_layernorm=True,
                        extra={"normalization": normalization})
    model = build_model(cfg)
    global_init(model, seed=5)
    attn = model.decoder.layers[0].self_attention
    centered = normalization == "LayerNorm"
    norms = [m for m in (getattr(attn, "q_layernorm", None), attn.kv_layernorm) if m is not None]
    with torch.no_grad():  # non-trivial latent-norm scales, so that folding them matters
        for i, m in enumerate(norms):
            m.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(i + 1))

    # 1) the derived bilinear forms reproduce megatron's own query·key
    x = torch.randn(6, 1, D, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        query, key = attn.get_query_key_value_tensors(x)[:2]  # [s, 1, n_local, QK + ROPE]
    forms, kv_down = _effective(attn, q_lora, centered)
    xs = x[:, 0].double()
    if q_lora is None:
        s_q = torch.ones(xs.shape[0], 1, dtype=torch.float64)
    else:
        q_down = _gather_rows(attn.linear_q_down_proj.weight.detach().double())
        s_q = _gain(xs @ q_down.T, attn.q_layernorm)
    s_kv = _gain(xs @ kv_down[:KV_LORA].T, attn.kv_layernorm)
    (wq, wk), (wqr, wkr) = forms["content"], forms["rope"]
    content_ref = torch.einsum("id,hkd,hke,je->hij", xs, wq, wk, xs) * s_q.view(1, -1, 1) * s_kv.view(1, 1, -1)
    content = torch.einsum("ihk,jhk->hij", query[:, 0, :, :QK].double(), key[:, 0, :, :QK].double())
    rope_ref = torch.einsum("id,hkd,hke,ie->hi", xs, wqr, wkr.expand_as(wqr), xs) * s_q.view(1, -1)
    rope = torch.einsum("ihk,ihk->hi", query[:, 0, :, QK:].double(), key[:, 0, :, QK:].double())
    forward_err = max(float((content - content_ref).abs().max() / content_ref.abs().max()),
                      float((rope - rope_ref).abs().max() / rope_ref.abs().max()))

    # 2) perturb every weight TP-consistently; the monitor snapshots the old state first
    monitor = MechanismMonitor(MonitorConfig(interval=1, delta=1, qk_terms=TERMS, families=["attention-spectral"],
                                             sinks=[], output_dir="unused"), model)
    old_forms = _effective(attn, q_lora, centered)[0]
    readers = {role: (lambda p=p: p) for role, p in mla_weights(attn).items()}
    old = _read_full(readers, attn)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    global_init(model, seed=6)
    steps = {n: p.detach() - before[n] if p.dim() >= 2 else
             torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.02
             for n, p in model.named_parameters()}

    def step_to(scale):  # weights = before + scale · step; returns the new forms and the monitor's inputs
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(before[n] + scale * steps[n])
        return _effective(attn, q_lora, centered)[0], _read_full(readers, attn)

    def spectra_error(new_forms, new, dtype):
        blocks = mla_qk_blocks({k: v.to(dtype) for k, v in old.items()}, {k: v.to(dtype) for k, v in new.items()},
                               layout)
        err = 0.0
        for part in ("content", "rope"):
            for term in TERMS:
                ref = _reference_sigma(old_forms[part], new_forms[part], term)
                sigma = mla_increment_singular_values(*blocks[part], term=term)[..., :ref.shape[-1]].double()
                err = max(err, float(((sigma - ref).abs() / ref[..., :1]).max()))
        return err

    layout = mla_layout_of(attn)
    tiny_forms, tiny = step_to(1e-6)  # an RL-sized step: the increments must stay resolved in float32
    tiny32 = spectra_error(tiny_forms, tiny, torch.float32)
    new_forms, new = step_to(0.3)
    errors = {dtype: spectra_error(new_forms, new, dtype) for dtype in (torch.float32, torch.float64)}

    # 3) the monitor end to end: per-head statistics of every term against the float64 reference's
    monitor.after_optimizer_step(1)
    rec = monitor.last["attention-spectral"]["layers"][0]
    stats_err = 0.0
    for part, prefix in (("content", ""), ("rope", "rope_")):
        for term in TERMS:
            ref = spectral_stats(_reference_sigma(old_forms[part], new_forms[part], term), matrix_dim=D)
            for i, h in enumerate(layout.local_heads()):
                got = rec[prefix + term]["heads"][h]
                for stat in ("entropy", "effective_rank", "stable_rank", "top1_energy", "frobenius"):
                    stats_err = max(stats_err, abs(got[stat] - float(ref[stat][i])) / abs(float(ref[stat][i])))
    return {"heads": layout.local_heads(), "forward": forward_err, "spectra32": errors[torch.float32], "tiny32": tiny32,
            "spectra64": errors[torch.float64], "stats": stats_err, "disabled": sorted(monitor.disabled),
            "terms": sorted(rec), "tp": ps.get_tensor_model_parallel_world_size()}


def mla_checks(plan):
    """mla_check for each (tp, q_lora, normalization) of `plan`, in one 2-rank world (TP=1 cases run at DP=2)."""
    return [mla_check(tp, q_lora, normalization) for tp, q_lora, normalization in plan]


PLAN = [(1, None, "RMSNorm"), (1, 16, "RMSNorm"), (1, 40, "LayerNorm"),  # input-space, compressed, full-rank q basis
        (2, 16, "RMSNorm"), (2, None, "RMSNorm")]


def cases():
    """PLAN, less the q_lora_rank=None cases where megatron-core (0.19+) builds their Q norm only with TE."""
    import importlib.util

    fused_q_norm = (importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config") is not None
                    and importlib.util.find_spec("transformer_engine") is None)
    return [case for case in PLAN if case[1] is not None or not fused_q_norm]


def test_mla_spectra_match_dense_float64_reference_at_tp1_and_tp2():
    plan = cases()
    ranks = run_distributed(mla_checks, 2, plan)
    for rank, outs in enumerate(ranks):
        for (tp, q_lora, normalization), out in zip(plan, outs):
            case = (tp, q_lora, normalization)
            local = rank if tp == 2 else 0
            assert out["tp"] == tp and out["heads"] == list(range(local * HEADS // tp, (local + 1) * HEADS // tp))
            assert "attention-spectral" not in out["disabled"], (case, out)
            assert out["terms"] == sorted(TERMS + [f"rope_{t}" for t in TERMS])
            assert out["forward"] <= 1e-5, (case, out)  # the derivation: megatron's q·k = gains × bilinear forms
            assert out["spectra64"] <= 1e-10, (case, out)  # the compressed core is exact
            assert out["spectra32"] <= 1e-4, (case, out)  # the monitor's float32 path: ≤ 1e-4 relative
            assert out["stats"] <= 1e-4, (case, out)
            assert out["tiny32"] <= 1e-3, (case, out)  # a 1e-6 relative step, float32
