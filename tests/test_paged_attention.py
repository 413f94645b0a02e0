"""mindspeed_proxy.paged_attention against a float64 attention written from flash-attn's documented semantics.

The reference takes each sequence's K/V as plain tensors; the paged cache under test is built by writing them into
shuffled blocks of a cache whose other slots hold NaN, so a wrong block lookup or a read past a length shows.
Tolerance: float32 inputs agree with the float64 reference within 2e-6 absolute (outputs are O(1)); bf16 within 2e-2.
"""
import itertools

import pytest
import torch

from mindspeed_proxy.paged_attention import flash_attn_varlen_func, flash_attn_with_kvcache

TOL32 = 2e-6


def reference(q, k, v, scale, causal, window=(-1, -1), with_lse=False):
    """float64 attention of one sequence: q [Sq, h, d], k/v [Sk, hk, d]; flash-attn's bottom-right causal mask and
    window [i + Sk - Sq - left, i + Sk - Sq + right]; with_lse: also the log-sum-exp [h, Sq] (+inf: no key)."""
    sq, heads, _ = q.shape
    sk, heads_k, _ = k.shape
    out = torch.zeros(sq, heads, v.shape[-1], dtype=torch.float64)
    lse = torch.full((heads, sq), float("inf"), dtype=torch.float64)
    left, right = window
    right = 0 if causal else right
    for h, i in itertools.product(range(heads), range(sq)):
        g = h // (heads // heads_k)
        diagonal = i + sk - sq
        keep = [j for j in range(sk) if (right < 0 or j <= diagonal + right) and (left < 0 or j >= diagonal - left)]
        if not keep:
            continue  # "If the row of the mask is all zero, the output will be zero."
        s = torch.stack([q[i, h].double() @ k[j, g].double() for j in keep]) * scale
        p = torch.softmax(s, dim=0)
        out[i, h] = sum(p[n] * v[j, g].double() for n, j in enumerate(keep))
        lse[h, i] = torch.logsumexp(s, dim=0)
    return (out, lse) if with_lse else out


def paged(ks, vs, block_size, seed, extra_blocks=3):
    """Write sequences ks, vs (lists of [L, hk, d]) into NaN-filled caches at shuffled blocks (unused table
    entries -1, as megatron pads); returns (k_cache, v_cache, block_table)."""
    need = [-(-k.shape[0] // block_size) for k in ks]
    total = sum(need) + extra_blocks
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    k_cache = torch.full((total, block_size, *ks[0].shape[1:]), float("nan"), dtype=ks[0].dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    table = torch.full((len(ks), max(need) + 2), -1, dtype=torch.int32)
    for b, (k, v) in enumerate(zip(ks, vs)):
        for n in range(need[b]):
            block = order.pop()
            table[b, n] = block
            rows = slice(n * block_size, (n + 1) * block_size)
            k_cache[block, :k[rows].shape[0]] = k[rows]
            v_cache[block, :v[rows].shape[0]] = v[rows]
    return k_cache, v_cache, table


def cu(lengths):
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)


def sequences(lengths, heads, dim, gen, dtype=torch.float32):
    return [torch.randn(n, heads, dim, generator=gen).to(dtype) for n in lengths]


@pytest.mark.parametrize("heads,heads_k", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_varlen_paged_prefill_with_prefix(heads, heads_k, block_size):
    """Mixed batch: fresh prompts (Sq = Sk), prompts after a cached prefix (Sq < Sk) and a decode row (Sq = 1)."""
    gen = torch.Generator().manual_seed(100 * heads + 10 * heads_k + block_size)
    q_lens, k_lens, dim = [5, 1, 9, 3, 6], [5, 7, 20, 3, 17], 8
    qs = sequences(q_lens, heads, dim, gen)
    ks, vs = sequences(k_lens, heads_k, dim, gen), sequences(k_lens, heads_k, dim, gen)
    k_cache, v_cache, table = paged(ks, vs, block_size, 7)
    out = flash_attn_varlen_func(torch.cat(qs), k_cache, v_cache, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens),
                                 causal=True, block_table=table)
    assert out.shape == (sum(q_lens), heads, dim) and out.dtype == torch.float32
    want = torch.cat([reference(q, k, v, dim ** -0.5, True) for q, k, v in zip(qs, ks, vs)])
    assert torch.allclose(out.double(), want, atol=TOL32, rtol=0), (out.double() - want).abs().max()


def test_varlen_contiguous_and_softmax_scale_and_noncausal():
    """block_table None: packed K/V with their own cu_seqlens_k; an explicit softmax_scale; causal and not."""
    gen = torch.Generator().manual_seed(3)
    q_lens, k_lens, heads, heads_k, dim = [4, 2, 7], [4, 6, 11], 6, 3, 16
    qs, ks, vs = sequences(q_lens, heads, dim, gen), sequences(k_lens, heads_k, dim, gen), \
        sequences(k_lens, heads_k, dim, gen)
    for causal in (True, False):
        out = flash_attn_varlen_func(torch.cat(qs), torch.cat(ks), torch.cat(vs), cu(q_lens), cu(k_lens),
                                     max(q_lens), max(k_lens), softmax_scale=0.3, causal=causal)
        want = torch.cat([reference(q, k, v, 0.3, causal) for q, k, v in zip(qs, ks, vs)])
        assert torch.allclose(out.double(), want, atol=TOL32, rtol=0)


def test_causal_mask_is_bottom_right_as_documented():
    """flash-attn's own examples: Sq=2, Sk=5 keeps [1 1 1 1 0; 1 1 1 1 1]; Sq=5, Sk=2 keeps rows 0-2 empty
    (output 0), then [1 0], [1 1]. With zero queries the weights are uniform over the kept keys and V = identity
    reads them out, so a top-left-aligned mask (or none) gives different numbers."""
    for sq, sk, keep in [(2, 5, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
                         (5, 2, [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]])]:
        keep = torch.tensor(keep, dtype=torch.float64)
        q, k = torch.zeros(sq, 1, sk), torch.randn(sk, 1, sk)
        v = torch.eye(sk).reshape(sk, 1, sk)
        out = flash_attn_varlen_func(q, k, v, cu([sq]), cu([sk]), sq, sk, causal=True)[:, 0].double()
        want = keep / keep.sum(dim=1, keepdim=True).clamp(min=1)
        assert torch.equal(out == 0, want == 0)
        assert torch.allclose(out, want, atol=1e-7, rtol=0)


def test_kvcache_paged_decode_gqa_and_padding_rows():
    """Decode-only batch: q [B, 1, h, d] over paged caches of different lengths; a padded row (length 0,
    block table -1, as megatron pads) gives zeros."""
    gen = torch.Generator().manual_seed(11)
    heads, heads_k, dim, block_size = 8, 2, 8, 4
    k_lens = [1, 6, 13, 4]
    ks, vs = sequences(k_lens, heads_k, dim, gen), sequences(k_lens, heads_k, dim, gen)
    k_cache, v_cache, table = paged(ks, vs, block_size, 5)
    table = torch.cat([table, torch.full((1, table.shape[1]), -1, dtype=torch.int32)])
    q = torch.randn(len(k_lens) + 1, 1, heads, dim, generator=gen)
    seqlens = torch.tensor(k_lens + [0], dtype=torch.int32)
    out = flash_attn_with_kvcache(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=seqlens, causal=True,
                                  block_table=table, num_splits=0)
    assert out.shape == q.shape
    for b, (k, v) in enumerate(zip(ks, vs)):
        want = reference(q[b], k, v, dim ** -0.5, True)
        assert torch.allclose(out[b].double(), want, atol=TOL32, rtol=0)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


def test_kvcache_several_queries_contiguous_cache():
    """Sq = 3 new queries per sequence over a non-paged cache [B, S_cache, hk, d]: bottom-right causal."""
    gen = torch.Generator().manual_seed(12)
    heads, heads_k, dim, k_lens = 4, 2, 8, [3, 9]
    k_cache = torch.full((2, 12, heads_k, dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, n in enumerate(k_lens):
        k_cache[b, :n] = torch.randn(n, heads_k, dim, generator=gen)
        v_cache[b, :n] = torch.randn(n, heads_k, dim, generator=gen)
    q = torch.randn(2, 3, heads, dim, generator=gen)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(k_lens, dtype=torch.int32),
                                  causal=True)
    for b, n in enumerate(k_lens):
        want = reference(q[b], k_cache[b, :n], v_cache[b, :n], dim ** -0.5, True)
        assert torch.allclose(out[b].double(), want, atol=TOL32, rtol=0)


def test_sliding_window_and_log_sum_exp():
    """megatron-core 0.19's extra arguments: window_size (sliding window) and the log-sum-exp (attention sinks),
    varlen with return_attn_probs -> (out, lse [h, total_q], None); kvcache with return_softmax_lse -> lse
    [B, h, Sq]."""
    gen = torch.Generator().manual_seed(14)
    q_lens, k_lens, heads, heads_k, dim, window = [4, 1, 6], [9, 5, 6], 4, 2, 8, (3, -1)
    qs = sequences(q_lens, heads, dim, gen)
    ks, vs = sequences(k_lens, heads_k, dim, gen), sequences(k_lens, heads_k, dim, gen)
    k_cache, v_cache, table = paged(ks, vs, 2, 9)
    out, lse, dmask = flash_attn_varlen_func(torch.cat(qs), k_cache, v_cache, cu(q_lens), cu(k_lens), 6, 9,
                                             causal=True, window_size=window, block_table=table,
                                             return_attn_probs=True)
    want = [reference(q, k, v, dim ** -0.5, True, window, with_lse=True) for q, k, v in zip(qs, ks, vs)]
    assert dmask is None and lse.shape == (heads, sum(q_lens))
    assert torch.allclose(out.double(), torch.cat([w[0] for w in want]), atol=TOL32, rtol=0)
    assert torch.allclose(lse.double(), torch.cat([w[1] for w in want], dim=1), atol=1e-5, rtol=0)
    q = torch.randn(2, 1, heads, dim, generator=gen)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(k_lens[:2], dtype=torch.int32),
                                       block_table=table[:2], causal=True, window_size=window,
                                       return_softmax_lse=True)
    for b in range(2):
        want_out, want_lse = reference(q[b], ks[b], vs[b], dim ** -0.5, True, window, with_lse=True)
        assert torch.allclose(out[b].double(), want_out, atol=TOL32, rtol=0)
        assert torch.allclose(lse[b].double(), want_lse, atol=1e-5, rtol=0)


def test_bf16_inputs_keep_dtype():
    """bf16 in, bf16 out (computed in float32): within 2e-2 of the float64 reference on the bf16 values."""
    gen = torch.Generator().manual_seed(13)
    q_lens, k_lens, heads, dim = [3, 5], [7, 5], 4, 16
    qs = sequences(q_lens, heads, dim, gen, torch.bfloat16)
    ks, vs = sequences(k_lens, heads, dim, gen, torch.bfloat16), sequences(k_lens, heads, dim, gen, torch.bfloat16)
    k_cache, v_cache, table = paged(ks, vs, 4, 1)
    out = flash_attn_varlen_func(torch.cat(qs), k_cache, v_cache, cu(q_lens), cu(k_lens), 5, 7, causal=True,
                                 block_table=table)
    assert out.dtype == torch.bfloat16
    want = torch.cat([reference(q, k, v, dim ** -0.5, True) for q, k, v in zip(qs, ks, vs)])
    assert torch.allclose(out.double(), want, atol=2e-2, rtol=0)


def test_unsupported_options_and_bad_heads_raise():
    """What megatron never passes is refused, not silently ignored; heads must divide."""
    q, k = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_varlen_func(q, k, k, cu([3]), cu([3]), 3, 3, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="k, v"):
        flash_attn_with_kvcache(q[None], k[None], k[None], k=k[None], v=k[None])
    with pytest.raises(ValueError, match="4 query heads are not a multiple of 3 KV heads"):
        flash_attn_varlen_func(q, k[:, :3], k[:, :3], cu([3]), cu([3]), 3, 3)
