"""Low-precision FlashAttention-2 emulator: the fault of arXiv 2510.04212, in plain fp32 torch.

All arithmetic runs in fp32; chosen intermediate tensors (``round_targets``) are rounded to a float
format with ``mantissa_bits`` explicit mantissa bits and fp32's exponent range, the way a bf16
FlashAttention kernel rounds them. Targets (forward ``F``, backward ``B``):

* ``"s"``  F+B: the score tile S = scale * Q K^T, after the matmul (turns near-ties into exact ties).
* ``"p"``  F: P̄ = exp(S - m) before P̄ V (the row sum l uses the unrounded P̄, as FA2 does in fp32);
           B: P = exp(S - lse) as the operand of dV = P^T dO (dS = P * (dP - D) uses the fp32 P, as FA2 does).
* ``"pv"`` F: the tile product P̄ V, the rescaled accumulator alpha * O and the sum O + P̄ V (bf16
           accumulation of O, as in the paper's pure-PyTorch kernel).
* ``"o"``  F: the normalised output O = O_acc / l; the backward's D = rowsum(dO * O) uses this O.
* ``"ds"`` B: dS before dQ = dS K * scale and dK = dS^T Q * scale.

Gradients treat every rounding as the identity (straight-through). Everything else (m, l, lse,
dP, D, the dQ/dK/dV accumulators) stays fp32.
"""
import math
from typing import Optional, Sequence, Union

import torch

FORMAT_MANTISSA_BITS = {"bf16": 7, "fp16": 10, "fp32": None}
ROUNDING_MODES = ("nearest-even", "toward-zero", "stochastic")
ROUND_TARGETS = ("s", "p", "pv", "o", "ds")
DEFAULT_ROUND_TARGETS = ("p", "pv")  # the P̄ and P̄V in low precision
FA2_KERNEL_ROUND_TARGETS = ("p", "o", "ds")  # what a bf16 FA2 CUDA kernel rounds (S, P̄V accumulate in fp32)

_FP32_MANTISSA_BITS = 23
_EXPONENT_MASK = 0x7F800000


def format_mantissa_bits(name: str) -> Optional[int]:
    """Explicit mantissa bits of a named format ("bf16" 7, "fp16" 10, "fp32" None = no rounding)."""
    try:
        return FORMAT_MANTISSA_BITS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; expected one of {sorted(FORMAT_MANTISSA_BITS)}") from None


def _resolve_bits(mantissa_bits: Union[int, str, None]) -> Optional[int]:
    if isinstance(mantissa_bits, str):
        mantissa_bits = format_mantissa_bits(mantissa_bits)
    if mantissa_bits is None or mantissa_bits >= _FP32_MANTISSA_BITS:
        return None
    if isinstance(mantissa_bits, bool) or not isinstance(mantissa_bits, int) or mantissa_bits < 1:
        raise ValueError(f"mantissa_bits must be an int in 1..23, a format name or None, got {mantissa_bits!r}")
    return mantissa_bits


def round_to_precision(
    x: torch.Tensor,
    mantissa_bits: Union[int, str, None],
    mode: str = "nearest-even",
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Round fp32 ``x`` to ``mantissa_bits`` explicit mantissa bits (fp32 exponent range), returned as fp32.

    Bit-exact on the fp32 representation: ``nearest-even`` equals ``x.to(torch.bfloat16)`` for 7 bits;
    ``toward-zero`` truncates the magnitude; ``stochastic`` rounds the magnitude up with probability
    equal to the dropped fraction of an ulp (random bits from ``generator``, else torch's default RNG).
    ±0 keep their sign, inf and NaN pass through unchanged, fp32 subnormals are rounded on the same
    absolute grid (gradual underflow of a format with fp32's exponent range), and a carry out of the
    largest finite value gives inf. fp16's narrower exponent range (overflow above 65504, subnormals
    below 2**-14) is NOT emulated: "fp16" only means 10 mantissa bits.
    """
    bits = _resolve_bits(mantissa_bits)
    if mode not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding mode {mode!r}; expected one of {ROUNDING_MODES}")
    if x.dtype != torch.float32:
        raise TypeError(f"round_to_precision expects float32, got {x.dtype}")
    if bits is None:
        return x
    drop = _FP32_MANTISSA_BITS - bits
    keep_mask = -(1 << drop)  # ...1110000 in two's complement: clears the dropped bits
    i = x.contiguous().view(torch.int32)
    if mode == "nearest-even":
        # Add half an ulp minus one, plus the kept LSB: exact ties go to the even neighbour.
        i = i + (((i >> drop) & 1) + ((1 << (drop - 1)) - 1))
    elif mode == "stochastic":
        device = generator.device if generator is not None else i.device
        noise = torch.randint(0, 1 << drop, i.shape, generator=generator, dtype=torch.int32, device=device)
        i = i + noise.to(i.device)
    # The sign bit is untouched by the additions above (magnitudes at most carry into inf), so
    # clearing the dropped bits rounds the magnitude: truncation for toward-zero.
    out = (i & keep_mask).view(torch.float32)
    finite = (x.contiguous().view(torch.int32) & _EXPONENT_MASK) != _EXPONENT_MASK
    return torch.where(finite, out, x)


class _Rounder:
    """Applies the rounding to the selected targets only."""

    def __init__(self, mantissa_bits, mode, targets, generator):
        self.bits = _resolve_bits(mantissa_bits)
        if mode not in ROUNDING_MODES:
            raise ValueError(f"unknown rounding mode {mode!r}; expected one of {ROUNDING_MODES}")
        unknown = set(targets) - set(ROUND_TARGETS)
        if unknown:
            raise ValueError(f"unknown round targets {sorted(unknown)}; expected a subset of {ROUND_TARGETS}")
        self.mode, self.targets, self.generator = mode, frozenset(targets), generator

    def __call__(self, target: str, x: torch.Tensor) -> torch.Tensor:
        if self.bits is None or target not in self.targets:
            return x
        return round_to_precision(x, self.bits, self.mode, self.generator)


def _causal_mask(i0, i1, j0, j1, offset, device):
    rows = torch.arange(i0, i1, device=device).unsqueeze(-1)
    cols = torch.arange(j0, j1, device=device)
    return cols > rows + offset


def _flash_forward(q, k, v, causal, scale, block_q, block_k, rnd):
    sq, sk = q.shape[-2], k.shape[-2]
    offset = sk - sq  # bottom-right causal alignment (FA2); equals Megatron's mask when sq == sk
    out = q.new_empty(q.shape[:-1] + v.shape[-1:])  # value head dim (MLA: differs from the q/k one)
    lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)
    for i0 in range(0, sq, block_q):
        i1 = min(i0 + block_q, sq)
        qi = q[..., i0:i1, :]
        m = torch.full(qi.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = qi.new_zeros(qi.shape[:-1] + v.shape[-1:])
        for j0 in range(0, sk, block_k):
            if causal and j0 > i1 - 1 + offset:
                break
            j1 = min(j0 + block_k, sk)
            s = rnd("s", torch.matmul(qi, k[..., j0:j1, :].transpose(-1, -2)) * scale)
            if causal:
                s = s.masked_fill(_causal_mask(i0, i1, j0, j1, offset, q.device), -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new.unsqueeze(-1))
            alpha = torch.exp(m - m_new)
            l = alpha * l + p.sum(dim=-1)
            pv = rnd("pv", torch.matmul(rnd("p", p), v[..., j0:j1, :]))
            acc = rnd("pv", rnd("pv", alpha.unsqueeze(-1) * acc) + pv)
            m = m_new
        out[..., i0:i1, :] = rnd("o", acc / l.unsqueeze(-1))
        lse[..., i0:i1] = m + torch.log(l)
    return out, lse


def _flash_backward(q, k, v, out, lse, dout, causal, scale, block_q, block_k, rnd):
    sq, sk = q.shape[-2], k.shape[-2]
    offset = sk - sq
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (dout * out).sum(dim=-1)  # D = rowsum(dO * O)
    for j0 in range(0, sk, block_k):
        j1 = min(j0 + block_k, sk)
        kj, vj = k[..., j0:j1, :], v[..., j0:j1, :]
        for i0 in range(0, sq, block_q):
            i1 = min(i0 + block_q, sq)
            if causal and j0 > i1 - 1 + offset:
                continue
            qi, doi = q[..., i0:i1, :], dout[..., i0:i1, :]
            s = rnd("s", torch.matmul(qi, kj.transpose(-1, -2)) * scale)
            if causal:
                s = s.masked_fill(_causal_mask(i0, i1, j0, j1, offset, q.device), -math.inf)
            p = torch.exp(s - lse[..., i0:i1].unsqueeze(-1))
            dv[..., j0:j1, :] += torch.matmul(rnd("p", p).transpose(-1, -2), doi)
            dp = torch.matmul(doi, vj.transpose(-1, -2))
            ds = rnd("ds", p * (dp - delta[..., i0:i1].unsqueeze(-1)))
            dq[..., i0:i1, :] += torch.matmul(ds, kj) * scale
            dk[..., j0:j1, :] += torch.matmul(ds.transpose(-1, -2), qi) * scale
    return dq, dk, dv


class FlashAttentionLowP(torch.autograd.Function):
    """Tiled FA2 forward/backward on fp32 [batch, heads, seq, dim] q, k, v (heads already expanded for GQA)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_q, block_k, mantissa_bits, rounding, round_targets, generator):
        """Online-softmax forward; returns O [batch, heads, sq, dim] and saves (q, k, v, O, lse)."""
        rounder = _Rounder(mantissa_bits, rounding, tuple(round_targets), generator)
        out, lse = _flash_forward(q, k, v, causal, scale, block_q, block_k, rounder)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (causal, scale, block_q, block_k, rounder)
        return out

    @staticmethod
    def backward(ctx, dout):
        """FA2 backward: recompute S and P from lse, then dV, dP, D, dS, dQ, dK tile by tile."""
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _flash_backward(q, k, v, out, lse, dout.contiguous(), *ctx.config)
        return (dq, dk, dv) + (None,) * 8


def lowp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    scale: Optional[float] = None,
    block_q: int = 64,
    block_k: int = 64,
    mantissa_bits: Union[int, str, None] = 7,
    rounding: str = "nearest-even",
    round_targets: Sequence[str] = DEFAULT_ROUND_TARGETS,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Attention in Megatron's core-attention layout: q [sq,b,np,hn], k [sk,b,ng,hn], v [sk,b,ng,hv] -> [sq,b,np*hv].

    The value head dim hv may differ from the query/key one hn (MLA: hn = qk_head_dim + qk_pos_emb_head_dim).

    Computed in fp32 whatever the input dtype (the result is cast back to it); ``mantissa_bits=None``
    (or "fp32") is exact fp32 FlashAttention-2. ``scale`` defaults to 1/sqrt(hn). ``causal`` masks key j
    for query i when j > i + (sk - sq), which is Megatron's causal mask for sq == sk; it needs sq <= sk.
    """
    sq, b, n_heads, hn = q.shape
    sk, n_groups, hv = k.shape[0], k.shape[2], v.shape[-1]
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or k.shape[1] != b or k.shape[3] != hn:
        raise ValueError(
            f"k must be [sk, b, ng, hn] and v [sk, b, ng, hv] matching q {tuple(q.shape)}, got {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if n_heads % n_groups:
        raise ValueError(f"query heads {n_heads} not a multiple of key/value groups {n_groups}")
    if causal and sq > sk:
        raise ValueError(f"causal attention needs sq <= sk, got sq={sq}, sk={sk}")
    if block_q < 1 or block_k < 1:
        raise ValueError("block sizes must be positive")
    _Rounder(mantissa_bits, rounding, tuple(round_targets), generator)  # validate before any work
    if n_heads != n_groups:  # GQA: query head h reads key/value group h // (np // ng), as in megatron-core
        k = k.repeat_interleave(n_heads // n_groups, dim=2)
        v = v.repeat_interleave(n_heads // n_groups, dim=2)
    scale = 1.0 / math.sqrt(hn) if scale is None else float(scale)

    def to_bhsd(t):
        return t.float().permute(1, 2, 0, 3).contiguous()

    out = FlashAttentionLowP.apply(
        to_bhsd(q), to_bhsd(k), to_bhsd(v), causal, scale, block_q, block_k,
        mantissa_bits, rounding, tuple(round_targets), generator,
    )
    return out.permute(2, 0, 1, 3).reshape(sq, b, n_heads * hv).to(q.dtype)
