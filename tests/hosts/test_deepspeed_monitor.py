"""The mechanism monitor on DeepSpeed: a tiny Qwen3-MoE (transformers) on 2 gloo ranks under ZeRO-1/2/3 gives the
same monitor values as the same model trained in 1 process without DeepSpeed; monitoring leaves the losses
bit-identical; a failing statistic is disabled on every rank and training goes on; ranks that own no layer
or fail alone leave no collective unmatched.

Tolerances (fp32, measured max in brackets): router statistics 1e-6 relative (1.1e-7), spectral statistics
1e-5 (ZeRO-1/2: identical; ZeRO-3: 7.6e-7), the mean loss over ranks 1e-6 (6e-8). The HF layout (GQA, q/k
norms) is checked against a float64 dense reference.
"""
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e '.[deepspeed]')")

from mindspeed_proxy.testing import run_distributed  # noqa: E402

STEPS = 4
MICRO, SEQ, VOCAB = 2, 16, 64
MONITOR = {"interval": 2, "delta": 2, "router_interval": 2, "qk_terms": ["delta1", "delta2"],
           "experts_per_layer": 2, "sinks": [], "families": ["attention-spectral", "update-spectral", "router"]}
ROUTER_RTOL, SPECTRAL_RTOL, LOSS_RTOL = 1e-6, 1e-5, 1e-6
# plain SGD and no clipping on both sides, so the reference is a few lines of torch
LR = 0.5


def tiny_model():
    """A 2-layer Qwen3-MoE: 4 query heads on 2 KV heads with q/k norms, 8 experts top-2 (same on every rank)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
                         attn_implementation="eager", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # the gate starts at zero in transformers: give the router something to route with
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model.train()


def global_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (2 * MICRO, SEQ), generator=g)


def ds_config(stage):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": 0.0,  # DeepSpeed's default: 1.0
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "mechanism_monitor": dict(MONITOR)}


def train_steps(engine, monitor, rank):
    """STEPS steps of this rank's micro-batches of the global batches; the monitor (or None) after each."""
    losses = []
    for step in range(STEPS):
        ids = global_batch(step)[rank * MICRO:(rank + 1) * MICRO]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if monitor is not None:
            monitor.step()
        losses.append(loss.item())
    return losses


def _train_ds(stage, monitored, fail_rank=None, layers=None):
    import deepspeed
    import torch.distributed as dist

    from mindspeed_proxy.hosts.deepspeed import attach_monitor

    config = ds_config(stage)
    if layers is not None:
        config["mechanism_monitor"]["layers"] = layers
    model = tiny_model()
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    monitor = attach_monitor(engine, config) if monitored else None
    rank = dist.get_rank()
    if monitor is not None and fail_rank == rank:
        def broken(*args):
            raise RuntimeError("injected failure in the attention-spectral family")
        monitor._layer_qk = broken
    out = {"losses": train_steps(engine, monitor, rank)}
    if monitor is not None:
        out.update(last=monitor.last, disabled=sorted(monitor.disabled), failures=sorted(monitor._failures))
        monitor.close()
    engine.destroy()
    return out


def init_gloo():
    """DeepSpeed on gloo with its CPU accelerator, compiling nothing (no shared-memory comm op)."""
    import deepspeed

    from mindspeed_proxy.hosts.deepspeed import skip_shm_comm_build

    assert skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")


def zero_stages():
    """Per stage: the monitored run and the unmonitored run's losses (one process per rank for all of them)."""
    init_gloo()
    return {stage: (_train_ds(stage, True), _train_ds(stage, False)["losses"]) for stage in (1, 2, 3)}


def failing_rank():
    """Rank 1 owns the only monitored layer and its QK statistic raises there."""
    init_gloo()
    return _train_ds(2, True, fail_rank=1, layers=[1]), _train_ds(2, False)["losses"]


def single_process(model=None, monitor_config=None):
    """The same model (default tiny_model()) and global batches, 1 process, torch SGD, no DeepSpeed, the monitor
    (default MONITOR) stepped by hand."""
    from mindspeed_proxy.hosts.hf_monitor import HFMonitor

    model = model if model is not None else tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    monitor = HFMonitor(monitor_config or MONITOR, model)
    losses = []
    for step in range(STEPS):
        ids = global_batch(step)
        # DeepSpeed averages the two ranks' mean losses; equal token counts make that the global mean
        loss = (model(input_ids=ids[:MICRO], labels=ids[:MICRO]).loss
                + model(input_ids=ids[MICRO:], labels=ids[MICRO:]).loss) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
        monitor.after_optimizer_step(step + 1)
        losses.append(loss.item())
    out = {"losses": losses, "last": monitor.last}
    monitor.close()
    return out


def _close(a, b, rtol, where):
    if isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _close(a[k], b[k], rtol, f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, rtol, f"{where}[{i}]")
    else:
        assert math.isfinite(a) and math.isfinite(b), f"{where}: {a} vs {b}"
        assert abs(a - b) <= rtol * max(abs(b), 1e-3), f"{where}: {a} vs {b} (rtol {rtol})"


@pytest.fixture(scope="module")
def reference():
    return single_process()


@pytest.fixture(scope="module")
def stages():
    return run_distributed(zero_stages, 2, timeout=600)


def test_reference_samples_every_family(reference):
    last = reference["last"]
    assert {"router", "update-spectral", "attention-spectral"} <= set(last)
    assert all(s["step"] == STEPS for s in last.values())
    assert sorted(last["router"]["layers"]) == [0, 1] and sorted(last["attention-spectral"]["layers"]) == [0, 1]
    slots = set(last["update-spectral"]["layers"][1])
    assert {"linear_qkv", "linear_proj", "router", "expert0.fc1", "expert4.fc2"} <= slots


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_matches_single_process(stages, reference, stage):
    runs = [s[stage][0] for s in stages]
    mean = [(a + b) / 2 for a, b in zip(runs[0]["losses"], runs[1]["losses"])]
    _close(mean, reference["losses"], LOSS_RTOL, f"ZeRO-{stage} mean loss over ranks")
    for rank, run in enumerate(runs):
        last, ref = run["last"], reference["last"]
        assert run["disabled"] == [] and run["failures"] == [], (run["disabled"], run["failures"])
        for family, rtol in (("router", ROUTER_RTOL), ("update-spectral", SPECTRAL_RTOL),
                             ("attention-spectral", SPECTRAL_RTOL)):
            assert last[family]["step"] == ref[family]["step"] == STEPS
            _close(last[family]["layers"], ref[family]["layers"], rtol, f"ZeRO-{stage} rank {rank} {family}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_monitoring_leaves_losses_bit_identical(stages, stage):
    for rank, (run, plain) in enumerate(s[stage] for s in stages):
        assert run["losses"] == plain, f"ZeRO-{stage} rank {rank}: monitored {run['losses']} != {plain}"


def test_failure_on_one_rank_disables_the_family_everywhere_and_training_goes_on():
    runs = run_distributed(failing_rank, 2, timeout=300)  # a collective left unmatched would time out
    for rank, (run, plain) in enumerate(runs):
        assert "attention-spectral" in run["disabled"], (rank, run["disabled"])
        assert "attention-spectral" not in run["last"]
        assert run["losses"] == plain
        # the surviving families still sample the one monitored layer, owned by rank 1 only
        assert sorted(run["last"]["update-spectral"]["layers"]) == [1]
        assert sorted(run["last"]["router"]["layers"]) == [1]
    assert runs[1][0]["failures"] == ["attention-spectral"] and runs[0][0]["failures"] == ["attention-spectral"]


def test_hf_layout_matches_float64_dense_reference():
    """Per-head Δ1/Δ2 spectra (GQA, q/k norm scales folded) and ΔW of [q; k; v] against float64 dense SVDs."""
    from mindspeed_proxy.hosts.hf_monitor import HFMonitor
    from mindspeed_proxy.monitor.config import STAT_NAMES
    from mindspeed_proxy.monitor.spectral_family import stats_vector

    model = tiny_model()
    attn = [layer.self_attn for layer in model.model.layers]
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for a in attn:
            for norm in (a.q_norm, a.k_norm):
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=g))
    old = [{n: getattr(a, n).weight.detach().double().clone() for n in ("q_proj", "k_proj", "v_proj", "q_norm",
                                                                          "k_norm")} for a in attn]
    monitor = HFMonitor({**MONITOR, "interval": 1, "delta": 1, "families": ["attention-spectral",
                                                                            "update-spectral"]}, model)
    with torch.no_grad():
        for a in attn:
            for n in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm"):
                w = getattr(a, n).weight
                w.add_(0.01 * torch.randn(w.shape, generator=g))
    monitor.after_optimizer_step(1)
    qk, upd = monitor.last["attention-spectral"]["layers"], monitor.last["update-spectral"]["layers"]
    heads, kv, hd = 4, 2, 8
    gram_floor = math.sqrt(max(2 * hd, 32) * torch.finfo(torch.float32).eps)
    for li, a in enumerate(attn):
        new = {n: getattr(a, n).weight.detach().double() for n in old[li]}

        def blocks(w, proj, norm, head):
            return (w[norm].view(hd, 1) * w[proj][head * hd:(head + 1) * hd]).T  # d × h

        for h in range(heads):
            k = h // (heads // kv)
            wq0, wk0 = blocks(old[li], "q_proj", "q_norm", h), blocks(old[li], "k_proj", "k_norm", k)
            wq1, wk1 = blocks(new, "q_proj", "q_norm", h), blocks(new, "k_proj", "k_norm", k)
            dense = {"delta1": wq1 @ wk1.T - wq0 @ wk0.T, "delta2": (wq1 - wq0) @ wk0.T + wq0 @ (wk1 - wk0).T}
            for term, m in dense.items():  # rank above the monitor's float32 Gram floor √(max(2h, d)·eps)·σ_max
                ref = dict(zip(STAT_NAMES, stats_vector(torch.linalg.svdvals(m), 32, rank_tol=gram_floor)
                               .double().tolist()))
                _close(qk[li][term]["heads"][h], ref, 1e-4, f"layer {li} head {h} {term}")
        delta = torch.cat([new[n] - old[li][n] for n in ("q_proj", "k_proj", "v_proj")])
        sigma = torch.linalg.svdvals(delta)
        ref = dict(zip(STAT_NAMES, stats_vector(sigma, 32, rank_tol=(32 * torch.finfo(sigma.dtype).eps) ** 0.5)
                       .double().tolist()))
        for stat in ("entropy", "stable_rank", "top1_energy", "frobenius", "effective_rank"):
            _close(upd[li]["linear_qkv"][stat], ref[stat], 1e-4, f"layer {li} linear_qkv {stat}")
    monitor.close()


def test_bad_config_and_model_are_one_line_errors(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from mindspeed_proxy.hosts.deepspeed import monitor_config
    from mindspeed_proxy.hosts.hf_monitor import HFMonitor

    assert monitor_config(ds_config(2)).interval == MONITOR["interval"]
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2}')
    with pytest.raises(ValueError, match=r'ds\.json: no "mechanism_monitor" block'):
        monitor_config(str(path))
    bad = {**ds_config(2), "mechanism_monitor": {"intervall": 3}}
    with pytest.raises(ValueError, match=r"mechanism_monitor.*unknown monitor config keys: \['intervall'\]"):
        monitor_config(bad)
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"model_type 'llama' is not supported") as err:
        HFMonitor(MONITOR, dense)
    assert "\n" not in str(err.value)
