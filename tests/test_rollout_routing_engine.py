"""The rollout routing of the train_rl.py rows, recorded from megatron-core's real dynamic inference engine.

The engine of tests/test_dynamic_inference.py (paged KV cache, chunked prefill, prefill/mixed/decode steps, requests
arriving at different steps) generates with the rows applied and RUNTIME.phase "rollout", as inside Megatron-LM's
`megatron_rl_inference_mode`. The router tap maps each flattened engine token to its request and position through
the patched `DynamicInferenceContext.current_input_and_position_ids`. Every position each request ran must come
back from the table with the experts (and routing probabilities) a plain full forward over prompt + generated
tokens chooses there, recorded independently with megatron-core's RouterReplay.
"""
import torch

from mindspeed_proxy.testing.launcher import run_distributed
from test_dynamic_inference import NEW_TOKENS, PROMPTS, build_engine


def _engine_and_reference():
    from megatron.core.inference.sampling_params import SamplingParams

    from mindspeed_proxy import patches
    from mindspeed_proxy.patches.rl_capture import CAPTURE
    from mindspeed_proxy.patches.runtime import RUNTIME
    from mindspeed_proxy.rl import replay
    from mindspeed_proxy.rl.sampler import model_logits
    from mindspeed_proxy.testing.parallel import init_parallel
    from mindspeed_proxy.tiny_moe import TinyMoEConfig, build_model

    init_parallel(ep=1, seed=5)
    handle = patches.apply(enable_monitor=False)
    RUNTIME.routing_replay, RUNTIME.rl_gap_interval = "r3", 1  # the capture on, probabilities recorded
    cfg = TinyMoEConfig(num_layers=2, seq_length=128, init_method_std=0.2, extra={"moe_enable_routing_replay": True})
    model = build_model(cfg).eval()
    engine, _ = build_engine(model, cfg)
    params = SamplingParams(top_k=1, return_log_probs=True, skip_prompt_log_probs=True,
                            num_tokens_to_generate=NEW_TOKENS, termination_id=-1)
    finished, step = [], 0
    CAPTURE.rollout, RUNTIME.phase = type(CAPTURE.rollout)(), "rollout"
    try:
        while step == 0 or engine.has_unfinished_requests():
            for request_id, (prompt, arrives) in PROMPTS.items():
                if arrives == step:
                    engine.add_request(request_id, prompt, params)
            finished += engine.step_modern()["finished_request_records"]
            step += 1
    finally:
        RUNTIME.phase = "train"
    table = CAPTURE.rollout.gather()
    out = {}
    for record in finished:
        request = record.merge()
        row = request.prompt_tokens.tolist() + list(request.generated_tokens)
        experts, recorded, probs = table.lookup(torch.tensor([row]), top_k=cfg.moe_router_topk, with_probs=True)
        hooks = replay.RoutingProbabilities(model)
        with torch.inference_mode(), replay.recording():  # the reference: a plain forward over the whole request
            model_logits(model, torch.tensor([row[:-1]]))
            reference = replay.take_recorded()  # [L, S-1, k]
            reference_probs = hooks.take()
        hooks.close()
        out[request.request_id] = dict(length=len(row), experts=experts[0], recorded=recorded[0], probs=probs[0],
                                       reference=reference, reference_probs=reference_probs)
    handle.revert()
    return out


def test_engine_routing_comes_back_per_request_and_position():
    """Each request's positions 0..S-2 (all the engine ran) are recorded with the full forward's experts and
    probabilities; the last token (never fed) is not."""
    results = run_distributed(_engine_and_reference, 1, timeout=300)[0]
    assert sorted(results) == sorted(PROMPTS)
    for request_id, got in results.items():
        ran = got["length"] - 1
        assert got["recorded"][:ran].all() and not got["recorded"][ran:].any(), request_id
        engine = got["experts"][:ran].sort(dim=-1).values  # [S-1, L, k]
        full = got["reference"].permute(1, 0, 2).sort(dim=-1).values
        assert torch.equal(engine, full), (request_id, (engine != full).any(-1).nonzero().tolist())
        order = got["reference"].permute(1, 0, 2).argsort(dim=-1)  # the reference's probabilities, ascending ids
        full_probs = got["reference_probs"].permute(1, 0, 2).gather(-1, order)
        assert torch.allclose(got["probs"][:ran], full_probs, atol=1e-5), request_id
