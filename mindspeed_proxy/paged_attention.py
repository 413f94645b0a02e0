"""flash-attn 2's `flash_attn_varlen_func` and `flash_attn_with_kvcache` in plain torch (paged KV cache, GQA).

megatron-core's dynamic inference engine calls these two functions (`Attention.flash_decode_and_prefill`)
and nothing else of flash-attn; this module gives them on a machine without flash-attn (CPU). Semantics
are flash-attn 2's documented ones (`flash_attn_interface.py`, 2.1 and later), for the arguments
megatron-core passes:

- q, k, v of shape [tokens, heads, head_dim]; K/V may have fewer heads (GQA/MQA): query head h reads
  KV head h // (nheads / nheads_k).
- Paged cache: with a `block_table` [batch, max_blocks] (int32), K/V are [num_blocks, block_size,
  nheads_k, d] and token t of sequence b lives at block `block_table[b, t // block_size]`, row
  `t % block_size`. Entries past a sequence's length are never read (megatron pads them with -1).
- Causal masking is aligned to the bottom-right corner: with seqlen_q queries over seqlen_k keys,
  query i (0-based) sees keys j <= i + seqlen_k - seqlen_q. A query row that sees no key gives 0.
- `softmax_scale` defaults to head_dim ** -0.5.

- `window_size=(left, right)` (sliding window, -1 = unbounded): query i sees keys in
  [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]; causal sets right to 0.
- The log-sum-exp of the scaled scores (megatron-core 0.19 asks for it with attention sinks) is
  returned as flash-attn does, +inf for a row that sees no key.

Arithmetic is done in float32 (float64 for float64 inputs) and the result has q's dtype. Dropout,
ALiBi, softcap, rotary and in-place cache appends are not implemented: asking for them raises.
"""
from __future__ import annotations

import torch

# The flash-attn release whose interface (names, arguments, shapes, masking) these functions follow.
FLASH_ATTN_API_VERSION = "2.7.4"


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _refuse(**options) -> None:
    """Raise for any flash-attn option this implementation does not provide, set to a non-default."""
    used = [name for name, (value, default) in options.items() if value != default]
    if used:
        raise NotImplementedError(f"mindspeed_proxy.paged_attention: {', '.join(used)} not supported "
                                  "(only what megatron-core's dynamic inference passes)")


def _lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)


def _pad_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Rows of packed x [total, ...] as a zero-padded [batch, width, ...] (sequence b from cu_seqlens[b])."""
    batch = lengths.numel()
    pos = torch.arange(width)
    index = (cu_seqlens[:-1].to(torch.long)[:, None] + pos[None, :]).clamp(max=max(x.shape[0] - 1, 0))
    out = x[index.reshape(-1)].reshape(batch, width, *x.shape[1:]) if x.shape[0] else \
        x.new_zeros(batch, width, *x.shape[1:])
    return _zero_past(out, lengths)


def _pad_paged(cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Tokens 0..lengths[b]-1 of each sequence read through its block table, as a zero-padded
    [batch, width, nheads_k, d]; slots past a length are zero whatever the cache holds there."""
    block_size = cache.shape[1]
    blocks = -(-width // block_size)
    if blocks > block_table.shape[1]:
        raise ValueError(f"block_table has {block_table.shape[1]} columns, {blocks} blocks of {block_size} tokens "
                         f"are needed for {width} keys")
    batch = lengths.numel()
    ids = block_table[:, :blocks].to(torch.long).clamp(min=0)
    out = cache[ids.reshape(-1)].reshape(batch, blocks * block_size, *cache.shape[2:])[:, :width]
    return _zero_past(out, lengths)


def _zero_past(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """x [B, S, ...] with rows at or past lengths[b] set to 0 (an unwritten cache slot may hold NaN)."""
    valid = torch.arange(x.shape[1])[None, :] < lengths[:, None]
    return torch.where(valid.view(*valid.shape, *[1] * (x.dim() - 2)), x, x.new_zeros(()))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_len: torch.Tensor, k_len: torch.Tensor,
            softmax_scale: float, causal: bool, window_size=(-1, -1)) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention of padded q [B, Sq, h, d] over padded k, v [B, Sk, hk, d]: (out [B, Sq, h, d],
    log-sum-exp of the scaled scores [B, h, Sq], +inf where a row sees no key, as flash-attn writes it)."""
    batch, sq, heads, dim = q.shape
    sk, heads_k = k.shape[1], k.shape[2]
    group = heads // heads_k
    dtype = _compute_dtype(q.dtype)
    qg = q.to(dtype).reshape(batch, sq, heads_k, group, dim)
    scores = torch.einsum("bqkgd,bskd->bkgqs", qg, k.to(dtype)) * softmax_scale
    i, j = torch.arange(sq)[None, :, None], torch.arange(sk)[None, None, :]
    diagonal = i + (k_len - q_len)[:, None, None]  # the key a query is aligned with (bottom-right)
    left, right = window_size
    allowed = j < k_len[:, None, None]  # [B, Sq, Sk]
    if causal:
        right = 0  # flash-attn: causal is the window (left, 0)
    if right >= 0:
        allowed = allowed & (j <= diagonal + right)
    if left >= 0:
        allowed = allowed & (j >= diagonal - left)
    allowed = allowed[:, None, None]  # [B, 1, 1, Sq, Sk]
    scores = scores.masked_fill(~allowed, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, peak.new_zeros(()))
    weights = torch.exp(scores - peak)
    total = weights.sum(dim=-1, keepdim=True)
    probs = torch.where(total > 0, weights / total.clamp_min(torch.finfo(dtype).tiny), weights.new_zeros(()))
    out = torch.einsum("bkgqs,bskd->bqkgd", probs, v.to(dtype)).reshape(batch, sq, heads, v.shape[-1])
    lse = torch.where(total > 0, peak + torch.log(total), torch.full_like(total, float("inf")))
    return out, lse.reshape(batch, heads, sq)


def _check_heads(q: torch.Tensor, k: torch.Tensor, where: str) -> None:
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"{where}: {q.shape[-2]} query heads are not a multiple of {k.shape[-2]} KV heads")


def _window(window_size) -> tuple[int, int]:
    return (-1, -1) if window_size is None else (int(window_size[0]), int(window_size[1]))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2's varlen attention: packed q [total_q, h, d] -> out [total_q, h, d] (paged K/V with a
    block_table); with return_attn_probs, (out, softmax_lse [h, total_q], None): no dropout, so no S_dmask."""
    _refuse(dropout_p=(dropout_p, 0.0), softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes is None, True))
    _check_heads(q, k, "flash_attn_varlen_func")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    q_len, k_len = _lengths(cu_seqlens_q), _lengths(cu_seqlens_k)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32)
    if q_len.numel():
        sq, sk = int(q_len.max()), int(k_len.max())
        qp = _pad_packed(q, cu_seqlens_q, q_len, sq)
        if block_table is None:
            kp, vp = _pad_packed(k, cu_seqlens_k, k_len, sk), _pad_packed(v, cu_seqlens_k, k_len, sk)
        else:
            kp, vp = _pad_paged(k, block_table, k_len, sk), _pad_paged(v, block_table, k_len, sk)
        padded, padded_lse = _attend(qp, kp, vp, q_len, k_len, scale, causal, _window(window_size))
        rows = torch.arange(sq)[None, :] < q_len[:, None]
        first = int(cu_seqlens_q[0])
        tokens = slice(first, first + int(q_len.sum()))
        out[tokens] = padded[rows].to(q.dtype)
        lse[:, tokens] = padded_lse.transpose(1, 2)[rows].t().float()
    return (out, lse, None) if return_attn_probs else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn 2's attention over a (paged) KV cache: q [B, Sq, h, d] over cache_seqlens keys -> out
    [B, Sq, h, d]; with return_softmax_lse, (out, softmax_lse [B, h, Sq])."""
    _refuse(k=(k is None, True), v=(v is None, True), rotary_cos=(rotary_cos is None, True),
            rotary_sin=(rotary_sin is None, True), cache_batch_idx=(cache_batch_idx is None, True),
            cache_leftpad=(cache_leftpad is None, True), softcap=(softcap, 0.0),
            alibi_slopes=(alibi_slopes is None, True))
    del num_splits  # how the kernel splits the keys; the result does not depend on it
    _check_heads(q, k_cache, "flash_attn_with_kvcache")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    batch, sq = q.shape[0], q.shape[1]
    if cache_seqlens is None:
        k_len = torch.full((batch,), k_cache.shape[1], dtype=torch.long)
    elif isinstance(cache_seqlens, int):
        k_len = torch.full((batch,), cache_seqlens, dtype=torch.long)
    else:
        k_len = cache_seqlens.to(torch.long).reshape(batch)
    sk = int(k_len.max()) if batch else 0
    if block_table is None:
        kp, vp = _zero_past(k_cache[:batch, :sk], k_len), _zero_past(v_cache[:batch, :sk], k_len)
    else:
        kp, vp = _pad_paged(k_cache, block_table, k_len, sk), _pad_paged(v_cache, block_table, k_len, sk)
    q_len = torch.full((batch,), sq, dtype=torch.long)
    out, lse = _attend(q, kp, vp, q_len, k_len, scale, causal, _window(window_size))
    return (out.to(q.dtype), lse.float()) if return_softmax_lse else out.to(q.dtype)
