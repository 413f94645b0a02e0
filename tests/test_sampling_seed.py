"""`--mechanism-offset-sampling-seed-by-dp-rank` on megatron-core's real dynamic engine, 2 data-parallel CPU ranks.

Without the flag (Megatron-LM core_v0.16-0.18 as it is) both ranks' TextGenerationControllers seed their sampler
with `inference_sampling_seed`, so the same prompt sampled on both ranks gives the same tokens; with it, rank r's
sampler starts from `inference_sampling_seed + r` and the samples differ. Row: patches/rl_sampling_seed.py.
"""
import torch

from mindspeed_proxy.testing.launcher import run_distributed
from test_dynamic_inference import build_engine

PROMPT, NEW = [3, 9, 4, 1, 5], 12


def _sample(offset: bool) -> dict:
    from megatron.core import parallel_state
    from megatron.core.inference.sampling_params import SamplingParams

    from mindspeed_proxy import patches
    from mindspeed_proxy.patches.runtime import RUNTIME
    from mindspeed_proxy.tiny_moe import TinyMoEConfig, build_model

    handle = patches.apply(enable_monitor=False)
    RUNTIME.offset_sampling_seed = offset
    try:
        cfg = TinyMoEConfig(num_layers=2, seq_length=64, init_method_std=0.2)
        model = build_model(cfg).eval()
        engine, controller = build_engine(model, cfg)
        seed = model.config.inference_sampling_seed
        state = controller.sampling_rng.get_state()
        params = SamplingParams(temperature=1.0, top_k=0, top_p=0.0, num_tokens_to_generate=NEW, termination_id=-1)
        engine.add_request(0, PROMPT, params)
        finished = []
        while engine.has_unfinished_requests():
            finished += engine.step_modern()["finished_request_records"]
        tokens = list(finished[0].merge().generated_tokens)
    finally:
        RUNTIME.offset_sampling_seed = False
        handle.revert()
    dp_rank = parallel_state.get_data_parallel_rank()
    started = {name: torch.equal(state, torch.Generator().manual_seed(s).get_state())
               for name, s in (("seed", seed), ("seed + dp rank", seed + dp_rank))}
    return dict(dp_rank=dp_rank, started=started, tokens=tokens)


def _sample_on_each_rank() -> dict:
    from mindspeed_proxy.testing.parallel import init_parallel

    init_parallel(seed=5)  # 2 ranks, TP = EP = 1: data-parallel size 2, the same weights on both ranks
    return {offset: _sample(offset) for offset in (False, True)}


def test_each_data_parallel_engine_samples_with_its_own_seed_only_with_the_flag():
    """Without the flag both ranks start from the one seed and draw the same tokens; with it rank r starts from
    seed + r and the two ranks' samples of the same prompt differ."""
    by_rank = run_distributed(_sample_on_each_rank, 2, timeout=300)
    for offset in (False, True):
        ranks = [r[offset] for r in by_rank]
        assert [r["dp_rank"] for r in ranks] == [0, 1]
        assert all(len(r["tokens"]) == NEW for r in ranks)
        if offset:
            assert all(r["started"]["seed + dp rank"] for r in ranks) and not ranks[1]["started"]["seed"]
            assert ranks[0]["tokens"] != ranks[1]["tokens"]
        else:
            assert all(r["started"]["seed"] for r in ranks)
            assert ranks[0]["tokens"] == ranks[1]["tokens"]


def test_the_flag_reaches_the_runtime_and_our_own_loop_refuses_it(monkeypatch):
    """Megatron-LM's command line (our flags parsed out of it, as the launcher does) switches the row on; our
    GRPO loop, whose sampler draws distinct numbers per sample, refuses the flag in one line naming it."""
    import pytest

    from mindspeed_proxy.monitor.arguments import monitor_flags_in
    from mindspeed_proxy.patches.rl_sampling_seed import apply_sampling_seed
    from mindspeed_proxy.patches.runtime import RUNTIME
    from mindspeed_proxy.training.arguments import ArgumentError, build_parser, validate_static

    monkeypatch.setattr(RUNTIME, "offset_sampling_seed", False)
    apply_sampling_seed(monitor_flags_in(["--seed", "3", "--mechanism-offset-sampling-seed-by-dp-rank"]))
    assert RUNTIME.offset_sampling_seed is True
    apply_sampling_seed(monitor_flags_in(["--seed", "3"]))
    assert RUNTIME.offset_sampling_seed is False
    with pytest.raises(ArgumentError, match="--mechanism-offset-sampling-seed-by-dp-rank is for Megatron-LM"):
        validate_static(build_parser().parse_args(["--mechanism-offset-sampling-seed-by-dp-rank"]))
