"""megatron-core's dynamic inference engine (what Megatron-LM's RL rolls out with) generating on the CPU platform.

A tiny GPT-MoE (GQA, RoPE) generates greedily through DynamicInferenceContext + GPTInferenceWrapper +
SimpleTextGenerationController + DynamicInferenceEngine, the objects Megatron-LM's `megatron/rl/inference/megatron.py`
builds, with a paged KV cache of 8-token blocks and at most 64 tokens a step (megatron pads a step to a multiple of
64). Requests arrive at different steps and a 75-token prompt is prefilled in two chunks, so the engine runs
prefill, mixed prefill+decode (queries after a cached prefix) and decode-only batches, i.e. both flash-attn
functions of mindspeed_proxy.paged_attention. Each request's generated tokens and log-probs are
checked against a plain full-sequence GPTModel.forward over prompt + generated tokens (log-softmax gather): the
tokens must be its argmax and the log-probs agree within 1e-4 (float32; measured differences are ~2e-6).
The same with EP=2 over 2 gloo ranks is a `slow` test (make test-all).
"""
import pytest
import torch

from mindspeed_proxy.testing.launcher import run_distributed

LOGPROB_TOL = 1e-4
PROMPTS = {  # request id -> (prompt token ids, engine step before which it is added)
    0: ([5, 9, 17, 3, 40], 0),
    1: ([7, 7, 100, 2, 9, 11, 30, 31, 33] + list(range(100, 166)), 0),  # 75 tokens: prefilled in two chunks
    2: ([250], 1),
    3: ([60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70], 2),
}
NEW_TOKENS = 5


class TokenIdTokenizer:
    """Text is space-separated token ids: what the controller needs of a tokenizer (the prompts are ids)."""

    eod = 0
    bos = None

    def tokenize(self, text):
        """Ids of a text of space-separated ints."""
        return [int(t) for t in text.split()]

    def detokenize(self, tokens, **kwargs):
        """Space-separated ids."""
        return " ".join(str(int(t)) for t in tokens)


def _counting(module, name, calls):
    """Replace module.name by a wrapper that counts its calls and, for the varlen function, records the largest
    query length of a sequence whose queries follow cached keys (Sq < Sk, Sq > 1: a prefill chunk after a prefix)."""
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        if name == "flash_attn_varlen_func":
            q_len, k_len = (torch.diff(args[i]).tolist() for i in (3, 4))
            chunks = [q for q, k in zip(q_len, k_len) if 1 < q < k]
            calls["chunk_after_prefix"] = max([calls.get("chunk_after_prefix", 0)] + chunks)
            calls["decode_in_mixed_batch"] = calls.get("decode_in_mixed_batch", 0) + \
                int(1 in q_len and any(q > 1 for q in q_len))
        return original(*args, **kwargs)

    setattr(module, name, counted)
    return original


def build_engine(model, cfg):
    """(DynamicInferenceEngine, its controller) over `model`: paged KV of 8-token blocks, at most 64 tokens a step."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
    from megatron.core.inference.text_generation_controllers.simple_text_generation_controller import (
        SimpleTextGenerationController)

    context = DynamicInferenceContext(
        params_dtype=torch.float32, num_layers=cfg.num_layers, kv_channels=cfg.hidden_size // cfg.num_attention_heads,
        num_attention_heads=cfg.num_query_groups, max_sequence_length=cfg.seq_length, block_size_tokens=8,
        buffer_size_gb=0.02, max_requests=8, max_tokens=64, materialize_only_last_token_logits=True)
    wrapper_config = InferenceWrapperConfig(hidden_size=cfg.hidden_size, params_dtype=torch.float32,
                                            inference_batch_times_seqlen_threshold=-1,
                                            padded_vocab_size=cfg.vocab_size)
    controller = SimpleTextGenerationController(
        inference_wrapped_model=GPTInferenceWrapper(model, wrapper_config, context), tokenizer=TokenIdTokenizer())
    return DynamicInferenceEngine(controller, context, random_seed=1, enable_chunked_prefill=True), controller


def _generate_and_reference(ep=1):
    """On each CPU rank (expert-parallel over `ep` ranks; rank r shifts every prompt id by r, same lengths): the
    engine's (prompt, tokens, logprobs) per request, the full-forward logprobs of the same tokens and the argmax
    tokens; how often each flash-attn function ran, and what the rows answer."""
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.transformer import attention

    from mindspeed_proxy.rl.sampler import model_logits, next_token_logprobs
    from mindspeed_proxy.testing.parallel import init_parallel
    from mindspeed_proxy.tiny_moe import TinyMoEConfig, build_model

    init_parallel(ep=ep, seed=5)
    shift = torch.distributed.get_rank()
    cfg = TinyMoEConfig(num_layers=2, seq_length=128, init_method_std=0.2)
    model = build_model(cfg).eval()
    engine, controller = build_engine(model, cfg)
    params = SamplingParams(top_k=1, return_log_probs=True, skip_prompt_log_probs=True,
                            num_tokens_to_generate=NEW_TOKENS, termination_id=-1)
    calls = {"is_fa_min_version 2.7.3": attention.is_fa_min_version("2.7.3"),
             "is_fa_min_version 2.8.0": attention.is_fa_min_version("2.8.0"),
             "sampling generator": str(controller.sampling_rng.device)}
    originals = {name: _counting(attention, name, calls)
                 for name in ("flash_attn_varlen_func", "flash_attn_with_kvcache")}
    finished, step = [], 0
    try:
        while step == 0 or engine.has_unfinished_requests():
            for request_id, (prompt, arrives) in PROMPTS.items():
                if arrives == step:
                    engine.add_request(request_id, [t + shift for t in prompt], params)
            finished += engine.step_modern()["finished_request_records"]
            step += 1
    finally:
        for name, original in originals.items():
            setattr(attention, name, original)
    engine.suspend()  # what Megatron-LM's RL does around each training phase: the KV cache is freed, then rebuilt
    engine.resume()
    for request_id in (0, 2):
        engine.add_request(100 + request_id, [t + shift for t in PROMPTS[request_id][0]], params)
    again = []
    while engine.has_unfinished_requests():
        again += engine.step_modern()["finished_request_records"]
    calls["after resume"] = {r.request_id - 100: (list(r.generated_tokens), list(r.generated_log_probs))
                             for r in (record.merge() for record in again)}
    results = {}
    with torch.inference_mode():  # as the engine: EP buffers it allocated are inference tensors
        for record in finished:
            request = record.merge()
            prompt, tokens = request.prompt_tokens.tolist(), list(request.generated_tokens)
            logp = next_token_logprobs(model_logits(model, torch.tensor([prompt + tokens[:-1]])), 1.0)[0]
            rows = logp[len(prompt) - 1:]
            reference = rows.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            results[request.request_id] = dict(
                prompt=[t - shift for t in prompt], tokens=tokens, logprobs=list(request.generated_log_probs),
                reference=reference.tolist(), argmax=rows.argmax(dim=1).tolist())
    return results, calls


@pytest.fixture(scope="module")
def generated():
    return run_distributed(_generate_and_reference, 1, timeout=300)[0]


def check_against_full_forward(results):
    """Greedy tokens are the full forward's argmax; their log-probs equal the full forward's within 1e-4."""
    assert sorted(results) == sorted(PROMPTS)
    for request_id, got in results.items():
        assert got["prompt"] == PROMPTS[request_id][0]
        assert len(got["tokens"]) == NEW_TOKENS
        assert got["tokens"] == got["argmax"], (request_id, got)
        diff = max(abs(a - b) for a, b in zip(got["logprobs"], got["reference"]))
        assert diff < LOGPROB_TOL, (request_id, diff)


def test_engine_tokens_and_logprobs_equal_full_forward(generated):
    """Greedy tokens are the full forward's argmax; their log-probs equal the full forward's within 1e-4."""
    check_against_full_forward(generated[0])


@pytest.mark.slow
def test_engine_with_expert_parallel_ranks():
    """EP=2 over 2 gloo ranks (the MoE all-gather dispatcher between the engines' forward passes): each rank's
    requests against its own full forward."""
    for results, _ in run_distributed(_generate_and_reference, 2, 2, timeout=600):
        check_against_full_forward(results)


def test_engine_ran_every_kind_of_batch(generated):
    """Prefill / mixed batches ran flash_attn_varlen_func, decode-only batches flash_attn_with_kvcache; a mixed
    batch held decode rows next to a prefill, and a prefill chunk of several queries attended after cached keys
    (the 75-token prompt's second chunk)."""
    _, calls = generated
    assert calls.get("flash_attn_varlen_func", 0) > 0 and calls.get("flash_attn_with_kvcache", 0) > 0, calls
    assert calls["decode_in_mixed_batch"] > 0 and calls["chunk_after_prefix"] > 1, calls


def test_engine_generates_the_same_after_suspend_and_resume(generated):
    """suspend() frees the KV cache and resume() rebuilds it (each RL iteration): the same prompts then give the
    same tokens, log-probs within 1e-5 (other batch companions, same math)."""
    results, calls = generated
    assert sorted(calls["after resume"]) == [0, 2]
    for request_id, (tokens, logprobs) in calls["after resume"].items():
        assert tokens == results[request_id]["tokens"]
        assert max(abs(a - b) for a, b in zip(logprobs, results[request_id]["logprobs"])) < 1e-5


def test_rows_answer_for_the_torch_functions(generated):
    """Under the CPU platform megatron's flash-attn check answers for the interface paged_attention follows (2.7.4:
    2.7.3 is enough, 2.8.0 is not) and the sampling generator is a CPU one."""
    _, calls = generated
    assert calls["is_fa_min_version 2.7.3"] is True and calls["is_fa_min_version 2.8.0"] is False
    assert calls["sampling generator"] == "cpu"


def test_without_the_platform_megatron_is_untouched():
    """Nothing activated (this process): megatron's own values, flash-attn's names None as it sets them without it."""
    import importlib.util

    from megatron.core.inference.text_generation_controllers import text_generation_controller
    from megatron.core.transformer import attention

    assert importlib.util.find_spec("flash_attn") is None
    assert attention.flash_attn_varlen_func is None and attention.flash_attn_with_kvcache is None
    assert text_generation_controller.torch is torch
