"""Per-head QK bilinear forms of megatron-core's multi-latent attention (`MLASelfAttention`), any TP.

For an attention input x (after the layer's input norm), head h scores the query token x against the
key token y with two terms (derivation in docs/monitor.md):

* content ("nope"): s_q(x) s_kv(y) · xᵀ W_q,c(h)ᵀ W_k,c(h) y with
  W_q,c(h) = U_q,c(h) Γ_q C_q W_qd (or the rows of `linear_q_proj` without q_lora_rank) and
  W_k,c(h) = U_k(h) Γ_kv C_kv W_kvd,c — U the up-projection rows of the head, Γ the latent norm's
  learnable scale, C the norm's centring (LayerNorm only), W_qd / W_kvd,c the down projections;
  s_q, s_kv > 0 are the per-token gains 1/rms (1/std) of the latent norms (1 without a norm);
* RoPE: s_q(x) · (R_i W_q,r(h) x)ᵀ (R_j W_k,r y) with the key W_k,r = the last qk_pos_emb_head_dim
  rows of `linear_kv_down_proj`, shared by all heads; at equal positions R_iᵀR_j = I.

The monitored operators are M_c(h) = W_q,cᵀ W_k,c and M_r(h) = W_q,rᵀ W_k,r (d×d). Their per-head
blocks [d, k] are returned in a compressed basis: every query block lies in the span of W_qdᵀ and
every content-key block in that of W_kvd,cᵀ, so an orthonormal basis of [W_oldᵀ, ΔWᵀ] (thin QR,
once per layer, shared by the heads) gives coordinates with the same Δ1/Δ2/Δ3 singular values.
The increments of the composite blocks are formed from differences of the stored factors (never as a
difference of two products), so they keep their precision when the step is tiny (RL learning rates).
TP: the up projections are column-parallel by head (local heads only); on the local spec the down
projections are column-parallel over their latent rows, so the caller passes them all-gathered
(`sharded_rows`; TE's spec keeps them duplicated). The latent norms' scales come from `q_layernorm` /
`kv_layernorm`, or, on TE's spec, from the `layer_norm_weight` fused into the up projections.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

# projections whose rows may be split over TP without regard to heads: pass them all-gathered
TP_GATHERED = ("q_down", "kv_down")
PARTS = ("content", "rope")


@dataclass(frozen=True)
class MLALayout:
    """Dimensions of one MLA layer and this rank's TP coordinate."""

    num_heads: int
    qk_head_dim: int
    rope_dim: int
    v_head_dim: int
    kv_lora_rank: int
    q_lora_rank: Optional[int] = None
    q_centered: bool = False  # LayerNorm on the query latent (mean removed before scaling)
    kv_centered: bool = False
    tp_size: int = 1
    tp_rank: int = 0

    def local_heads(self) -> list[int]:
        """Global indices of the query heads this TP rank computes."""
        per_rank = self.num_heads // self.tp_size
        return list(range(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank))


def is_mla(attention) -> bool:
    """Whether `attention` is megatron-core's multi-latent attention."""
    return hasattr(attention, "linear_kv_down_proj") and hasattr(attention, "linear_kv_up_proj")


def _centered(norm) -> bool:
    return isinstance(norm, torch.nn.LayerNorm) or getattr(norm, "normalization", None) == "LayerNorm"


def _fused_norm(attention, up: str) -> bool:
    return isinstance(getattr(getattr(attention, up, None), "layer_norm_weight", None), torch.Tensor)


def mla_layout_of(attention) -> MLALayout:
    """MLALayout of a megatron-core MLASelfAttention at the current TP size/rank."""
    from megatron.core import parallel_state as ps

    c = attention.config
    return MLALayout(num_heads=c.num_attention_heads, qk_head_dim=c.qk_head_dim, rope_dim=c.qk_pos_emb_head_dim,
                     v_head_dim=c.v_head_dim, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank,
                     q_centered=_centered(getattr(attention, "q_layernorm", None)) or (
                         _fused_norm(attention, "linear_q_up_proj") and c.normalization == "LayerNorm"),
                     kv_centered=_centered(getattr(attention, "kv_layernorm", None)) or (
                         _fused_norm(attention, "linear_kv_up_proj") and c.normalization == "LayerNorm"),
                     tp_size=ps.get_tensor_model_parallel_world_size(),
                     tp_rank=ps.get_tensor_model_parallel_rank())


def mla_weights(attention) -> dict[str, torch.Tensor]:
    """The projection weights of an MLASelfAttention by role: q_proj or q_down/q_up, kv_down, kv_up."""
    if getattr(attention, "linear_q_proj", None) is not None:
        out = {"q_proj": attention.linear_q_proj.weight}
    else:
        out = {"q_down": attention.linear_q_down_proj.weight, "q_up": attention.linear_q_up_proj.weight}
    out.update(kv_down=attention.linear_kv_down_proj.weight, kv_up=attention.linear_kv_up_proj.weight)
    return out


def mla_read(readers: dict[str, Callable[[], torch.Tensor]], attention, zero_centered: bool = False
             ) -> dict[str, torch.Tensor]:
    """Current weights (from `readers`) and the latent norms' effective scales (q_scale, kv_scale) when learnable."""
    from mindspeed_proxy.monitor.qk_layout import layernorm_scale

    state = {name: read() for name, read in readers.items()}
    for key, norm, up in (("q_scale", "q_layernorm", "linear_q_up_proj"),
                          ("kv_scale", "kv_layernorm", "linear_kv_up_proj")):
        scale = layernorm_scale(getattr(attention, norm, None), zero_centered)
        if scale is None and _fused_norm(attention, up):  # TE: TELayerNormColumnParallelLinear
            weight = getattr(attention, up).layer_norm_weight
            scale = weight + 1 if zero_centered else weight
        if scale is not None:
            state[key] = scale
    return state


def sharded_rows(name: str, weight: torch.Tensor, layout: MLALayout) -> bool:
    """Whether this rank's down projection `name` (q_down / kv_down) holds only its TP share of the latent rows."""
    full = layout.q_lora_rank if name == "q_down" else layout.kv_lora_rank + layout.rope_dim
    return layout.tp_size > 1 and weight.shape[0] != full


def _down(weight: torch.Tensor, rows: slice, centered: bool) -> torch.Tensor:
    """Rows of a down projection as a [d, k] block, with LayerNorm's centring C = I − 11ᵀ/k folded in."""
    w = weight[rows]
    if centered:
        w = w - w.mean(dim=0, keepdim=True)
    return w.mT


def _coordinates(old: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Coordinates of [d, k] blocks W_old and ΔW in an orthonormal basis of their joint span (identity if 2k ≥ d).

    The basis is the thin QR of [W_old, ΔW]: Householder QR is columnwise backward stable, so the
    coordinates of ΔW are accurate relative to ‖ΔW‖, not only to ‖W‖ (a step of 1e-6·W stays resolved)."""
    d, k = old.shape
    if 2 * k >= d:
        return old, delta
    r = torch.linalg.qr(torch.cat([old, delta], dim=1), mode="r").R  # [W_old, ΔW] = Q R
    return r[:, :k], r[:, k:]


def _chain(c_old, c_delta, up_old, up_new, g_old=None, g_new=None):
    """Old per-head block and exact increment of W = c·diag(g)·upᵀ ([m, k], [heads, rows, k] -> [heads, m, rows]).

    W_new − W_old = Δc·G_new·U_newᵀ + c_old·(ΔG·U_newᵀ + G_old·ΔUᵀ): every term is computed from a
    difference of stored factors, so no cancellation of two nearly equal products."""
    def mul(c, g, u):
        return torch.einsum("mk,hrk->hmr", c if g is None else c * g, u)

    d_up = up_new - up_old
    old = mul(c_old, g_old, up_old)
    if g_old is None:
        return old, mul(c_delta, None, up_new) + mul(c_old, None, d_up)
    return old, mul(c_delta, g_new, up_new) + mul(c_old, g_new - g_old, up_new) + mul(c_old, g_old, d_up)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[-2])) if x.shape[-2] < rows else x


@torch.no_grad()
def mla_qk_blocks(old: dict, new: dict, layout: MLALayout, heads: Optional[torch.Tensor] = None
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{"content" | "rope": (Wq_old, ΔWq, Wk_old, ΔWk)} per-head blocks [heads, m, k] in a shared basis.

    `old` / `new` are `mla_read` outputs (any float dtype, computed in it) with the sharded down
    projections all-gathered; `heads` selects positions among this rank's local heads. Content keys
    are per head; the RoPE key blocks have a leading 1 (shared by all heads, broadcast). Query and key
    blocks are zero-padded to the same m. Increments are exact differences (see `_chain`).
    """
    L = layout
    qk, q_rows = L.qk_head_dim, L.qk_head_dim + L.rope_dim
    n_local = L.num_heads // L.tp_size

    def pick(x):
        return x if heads is None else x[heads]

    def basis(name, rows, centered):  # coordinates of a down projection's old rows and of their change
        return _coordinates(_down(old[name], rows, centered), _down(new[name] - old[name], rows, centered))

    if L.q_lora_rank is None:  # queries straight from x: blocks in input space
        q_old, q_new = (pick(s["q_proj"].view(n_local, q_rows, -1)).mT for s in (old, new))
        q_delta = q_new - q_old
        q_blocks = {"content": (q_old[..., :qk], q_delta[..., :qk]),
                    "rope": (q_old[..., qk:], q_delta[..., qk:])}
    else:
        c_old, c_delta = basis("q_down", slice(None), L.q_centered)
        up_old, up_new = (pick(s["q_up"].view(n_local, q_rows, -1)) for s in (old, new))
        q_blocks = {part: _chain(c_old, c_delta, up_old[:, rows], up_new[:, rows], old.get("q_scale"),
                                 new.get("q_scale"))
                    for part, rows in (("content", slice(0, qk)), ("rope", slice(qk, q_rows)))}
    c_old, c_delta = basis("kv_down", slice(0, L.kv_lora_rank), L.kv_centered)
    kup_old, kup_new = (pick(s["kv_up"].view(n_local, qk + L.v_head_dim, -1))[:, :qk] for s in (old, new))
    k_blocks = {"content": _chain(c_old, c_delta, kup_old, kup_new, old.get("kv_scale"), new.get("kv_scale"))}
    r_old, r_delta = basis("kv_down", slice(L.kv_lora_rank, L.kv_lora_rank + L.rope_dim), False)  # shared key
    k_blocks["rope"] = (r_old.unsqueeze(0), r_delta.unsqueeze(0))
    out = {}
    for part in PARTS:
        (q_o, q_d), (k_o, k_d) = q_blocks[part], k_blocks[part]
        m = max(q_o.shape[-2], k_o.shape[-2])
        out[part] = tuple(_pad_rows(x, m) for x in (q_o, q_d, k_o, k_d))
    return out


@torch.no_grad()
def mla_increment_singular_values(wq_old, dwq, wk_old, dwk, term: str = "delta2") -> torch.Tensor:
    """Singular values of Δ1, Δ2 or Δ3 of M = Wq Wkᵀ from old blocks and exact increments ([..., m, k]).

    Δ2 = [ΔWq, Wq]·[Wk, ΔWk]ᵀ, Δ3 = ΔWq·ΔWkᵀ, Δ1 = Δ2 + Δ3 = [ΔWq, Wq]·[Wk + ΔWk, ΔWk]ᵀ: no factor is a
    difference, so the result stays accurate relative to the increment. Leading dims broadcast.
    """
    from mindspeed_proxy.monitor.spectral import lowrank_product_singular_values

    def cat(x, y):
        x, y = torch.broadcast_tensors(x, y)
        return torch.cat([x, y], dim=-1)

    if term == "delta2":
        return lowrank_product_singular_values(cat(dwq, wq_old), cat(wk_old, dwk))
    if term == "delta3":
        return lowrank_product_singular_values(dwq, dwk)
    if term == "delta1":
        return lowrank_product_singular_values(cat(dwq, wq_old), cat(wk_old + dwk, dwk))
    raise ValueError(f"term must be delta1, delta2 or delta3, got {term!r}")


def mla_increment_rank_tol(wq_old, dwq, wk_old, dwk, term: str = "delta2", matrix_dim: int = 0) -> Optional[float]:
    """The rank floor of `mla_increment_singular_values`' σ of `term` from these blocks (`spectral_routes`)."""
    from mindspeed_proxy.monitor.spectral import compute_dtype
    from mindspeed_proxy.monitor.spectral_routes import lowrank_rank_tol

    rows, k = max(wq_old.shape[-2], wk_old.shape[-2]), wq_old.shape[-1]
    return lowrank_rank_tol(rows, k if term == "delta3" else 2 * k, compute_dtype(wq_old, dwq, wk_old, dwk),
                            matrix_dim)


def attention_terms(qk_terms: list[str], model_config) -> list[str]:
    """Names of the attention-spectral terms: `qk_terms` (MLA: the content form), then MLA's `rope_{term}`."""
    if getattr(model_config, "multi_latent_attention", False):
        return list(qk_terms) + [f"rope_{t}" for t in qk_terms]
    return list(qk_terms)
