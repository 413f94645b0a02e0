"""Router monitors: weight geometry (similarity, conditioning) and per-step routing accumulators."""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from mindspeed_proxy.monitor.spectral import compute_dtype

# Per-layer layout of the flat accumulator: [tokens, entropy_sum, margin_sum, load_0 .. load_{E-1}].
_TOKENS, _ENTROPY, _MARGIN, _LOAD = 0, 1, 2, 3


@torch.no_grad()
def router_weight_stats(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Similarity S, conditioning ratio ε and row-norm stats of router weights [..., E, H] (fp32 or better).

    S is the mean pairwise cosine similarity over i ≠ j, computed as (E²‖ū‖² − Σ‖u_i‖²)/(E(E−1))
    with u_i the unit rows; that equals (E‖ū‖² − 1)/(E − 1) when no row is zero (a zero row has
    cosine 0 with every row). S = 1 when E = 1. ε = max_i ‖w_i − w̄‖ / ‖w̄‖ with w̄ the mean row;
    ε = 0 when all rows are equal (all-zero included), +inf when ‖w̄‖ = 0 and rows differ.
    """
    w = weight.to(compute_dtype(weight))
    num_experts = w.shape[-2]
    norms = w.norm(dim=-1)
    unit = w / torch.where(norms > 0, norms, torch.ones_like(norms)).unsqueeze(-1)
    unit_sq = unit.square().sum(dim=(-2, -1))
    sum_sq = unit.sum(dim=-2).square().sum(dim=-1)
    if num_experts > 1:
        similarity = (sum_sq - unit_sq) / (num_experts * (num_experts - 1))
    else:
        similarity = torch.ones_like(sum_sq)

    mean_row = w.mean(dim=-2, keepdim=True)
    spread = (w - mean_row).norm(dim=-1).amax(dim=-1)
    mean_norm = mean_row.squeeze(-2).norm(dim=-1)
    ratio = spread / torch.where(mean_norm > 0, mean_norm, torch.ones_like(mean_norm))
    ratio = torch.where(mean_norm > 0, ratio, torch.full_like(ratio, math.inf))
    ratio = torch.where(spread > 0, ratio, torch.zeros_like(ratio))
    return {
        "similarity": similarity,
        "conditioning_ratio": ratio,
        "row_norm_mean": norms.mean(dim=-1),
        "row_norm_max": norms.amax(dim=-1),
    }


class RouterStats:
    """Fixed-size fp32 accumulators of routing statistics for L layers × E experts, reducible in one all-reduce.

    Token counts are stored in float32 so one flat tensor carries everything; they are exact up to
    2^24 tokens per layer between resets and within 6e-8 relative beyond.
    """

    def __init__(self, num_layers: int, num_experts: int, topk: int, device=None, chunk_size: int = 8192,
                 pending_bytes: int = 16 << 20):
        if num_layers < 1 or num_experts < 1 or not 1 <= topk <= num_experts:
            raise ValueError(f"need num_layers ≥ 1, num_experts ≥ 1, 1 ≤ topk ≤ num_experts; got "
                             f"{num_layers}, {num_experts}, {topk}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.topk = topk
        self.chunk_size = chunk_size
        self.pending_bytes = pending_bytes
        self._buffer = torch.zeros(num_layers, _LOAD + num_experts, dtype=torch.float32, device=device)
        self._pending: list = []  # (layer, fp32 logits [n, E], tokens per expert [E] or None: from the top-k)
        self._held = 0

    @property
    def device(self) -> torch.device:
        """Device of the accumulators."""
        return self._buffer.device

    def reset(self) -> None:
        """Zero every accumulator (calls not yet folded in are dropped too)."""
        self._pending, self._held = [], 0
        self._buffer.zero_()

    def as_tensor(self) -> torch.Tensor:
        """The flat fp32 accumulator, every call folded in (a view: reducing it in place reduces the stats)."""
        self.flush()
        return self._buffer.view(-1)

    @torch.no_grad()
    def update(self, layer_index: int, logits: torch.Tensor, topk_indices: Optional[torch.Tensor] = None) -> None:
        """Accumulate one layer's routing: logits [..., E] before top-k; topk_indices [..., k] or a bool routing map [..., E].

        Adds the token count, Σ over tokens of the softmax entropy over all E (fp32), the Σ of the top-k
        margin logit_(k) − logit_(k+1) (0 when k = E) and the tokens per expert from `topk_indices`
        (derived from the logits' top-k when None). The call keeps a copy and folds it in with the other
        held calls in one batch (`flush`, at the latest when `pending_bytes` are held or the sums are read):
        this runs inside every router forward, where a dozen small kernels per call cost more than the
        arithmetic (benchmarks/bench_monitor_overhead.py).
        """
        if not 0 <= layer_index < self.num_layers:
            raise IndexError(f"layer_index {layer_index} out of range for {self.num_layers} layers")
        num_experts = self.num_experts
        if logits.shape[-1] != num_experts:
            raise ValueError(f"logits last dim {logits.shape[-1]} != num_experts {num_experts}")
        flat = logits.detach().reshape(-1, num_experts)
        load = None  # tokens per expert [E] when the caller says which experts were chosen (one kernel)
        if topk_indices is not None:
            load = (torch.sum(topk_indices.detach().reshape(-1, num_experts), dim=0, dtype=torch.float32)
                    if topk_indices.dtype == torch.bool
                    else torch.bincount(topk_indices.detach().reshape(-1), minlength=num_experts).float())
        nbytes = flat.shape[0] * num_experts * 4
        if nbytes >= self.pending_bytes:  # a large call: folded in at once, without a copy of its logits
            self.flush()
            self._fold([(layer_index, flat, load)])
            return
        self._pending.append((layer_index, flat.to(torch.float32, copy=True), load))
        self._held += nbytes
        if self._held >= self.pending_bytes:
            self.flush()

    @torch.no_grad()
    def flush(self) -> None:
        """Fold every held call into the accumulators."""
        pending, self._pending, self._held = self._pending, [], 0
        if pending:
            self._fold(pending)

    def _fold(self, calls: list) -> None:
        by_layer: dict = {}
        for layer, logits, load in calls:
            by_layer.setdefault(layer, []).append((logits, load))
        for layer, items in by_layer.items():  # layer by layer: plain sums, deterministic on every device
            row = self._buffer[layer]
            given = [load for _, load in items if load is not None]
            if given:
                row[_LOAD:] += torch.stack(given).sum(dim=0) if len(given) > 1 else given[0]
            for derive in (False, True):
                part = [logits for logits, load in items if (load is None) == derive]
                if part:
                    self._fold_rows(row, torch.cat(part) if len(part) > 1 else part[0], derive)

    def _fold_rows(self, row: torch.Tensor, logits: torch.Tensor, derive_load: bool) -> None:
        num_experts, k = self.num_experts, self.topk
        width = min(k + 1, num_experts)
        row[_TOKENS] += logits.shape[0]
        for start in range(0, logits.shape[0], self.chunk_size):
            chunk = logits[start:start + self.chunk_size].float()
            # the experts along dim 0: a softmax or top-k over a short last dim runs a slow per-token loop;
            # entr() gives 0·log 0 = 0 for −inf logits and keeps NaN
            by_expert = chunk.T.contiguous()
            row[_ENTROPY] += torch.special.entr(torch.softmax(by_expert, dim=0)).sum()
            if derive_load:
                top = torch.topk(chunk, width, dim=-1, sorted=True)
                row[_LOAD:] += torch.bincount(top.indices[:, :k].reshape(-1), minlength=num_experts).float()
                if width > k:
                    row[_MARGIN] += (top.values[:, k - 1] - top.values[:, k]).sum()
            elif width > k:
                kth, next_ = _kth_and_next(by_expert, k, chunk)
                row[_MARGIN] += (kth - next_).sum()

    def reduce(self, groups: Iterable) -> None:
        """All-reduce (SUM) the accumulators over each process group in order; None entries are skipped."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        self.flush()
        for group in groups:
            if group is not None:
                dist.all_reduce(self._buffer, op=dist.ReduceOp.SUM, group=group)

    def load(self) -> torch.Tensor:
        """Tokens routed to each expert so far, [L, E]."""
        self.flush()
        return self._buffer[:, _LOAD:]

    def summary(self, ep_size: int = 1) -> dict[str, torch.Tensor]:
        """Per-layer statistics ([L] tensors unless noted); layers that saw no tokens report 0 everywhere.

        Keys: tokens; entropy (mean per-token routing entropy) and normalized_entropy (÷ log E);
        load [L, E]; load_entropy and normalized_load_entropy of the load distribution;
        max_over_mean load; dead_experts (experts with 0 tokens); overload (max over the ep_size
        contiguous expert groups of the group load ÷ mean group load); margin (mean top-k margin).
        """
        num_experts = self.num_experts
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"ep_size {ep_size} must divide num_experts {num_experts}")
        self.flush()
        buf = self._buffer
        tokens = buf[:, _TOKENS]
        seen = tokens > 0
        safe_tokens = torch.where(seen, tokens, torch.ones_like(tokens))
        entropy = buf[:, _ENTROPY] / safe_tokens
        load = buf[:, _LOAD:]
        assigned = load.sum(dim=-1)
        has_load = assigned > 0
        frac = load / torch.where(has_load, assigned, torch.ones_like(assigned)).unsqueeze(-1)
        load_entropy = torch.special.entr(frac).sum(dim=-1)
        log_e = math.log(num_experts) if num_experts > 1 else 1.0
        zero = torch.zeros_like(tokens)
        return {
            "tokens": tokens.clone(),
            "entropy": entropy,
            "normalized_entropy": entropy / log_e if num_experts > 1 else zero,
            "load": load.clone(),
            "load_entropy": load_entropy,
            "normalized_load_entropy": load_entropy / log_e if num_experts > 1 else zero,
            "max_over_mean": _max_over_mean(load),
            "dead_experts": torch.where(has_load, (load == 0).sum(dim=-1).float(), zero),
            "overload": _max_over_mean(load.view(self.num_layers, ep_size, -1).sum(dim=-1)),
            "margin": buf[:, _MARGIN] / safe_tokens,
        }

    def winner_persistence(self, prev_load: torch.Tensor, top: Optional[int] = None) -> torch.Tensor:
        """Overlap fraction of the top-n loaded experts between `prev_load` [L, E] and the current load (n = topk)."""
        return winner_persistence(prev_load, self.load(), top=top or self.topk)


def _kth_and_next(by_expert: torch.Tensor, k: int, tokens_first: torch.Tensor):
    """The k-th and (k+1)-th largest logit of each token, from logits [E, tokens]: for a few experts a running
    sorted top-(k+1) over the E rows (elementwise ops over all tokens at once), else torch.topk."""
    if by_expert.shape[0] > 16:
        values = torch.topk(tokens_first, k + 1, dim=-1, sorted=True).values
        return values[:, k - 1], values[:, k]
    best = [torch.full_like(by_expert[0], -math.inf) for _ in range(k + 1)]
    for values in by_expert:
        for j in range(k + 1):  # insert `values` into best[0] >= best[1] >= ... (NaN propagates like topk's)
            best[j], values = torch.maximum(best[j], values), torch.minimum(best[j], values)
    return best[k - 1], best[k]


def _max_over_mean(load: torch.Tensor) -> torch.Tensor:
    total = load.sum(dim=-1)
    ratio = load.amax(dim=-1) * load.shape[-1] / torch.where(total > 0, total, torch.ones_like(total))
    return torch.where(total > 0, ratio, torch.zeros_like(ratio))


@torch.no_grad()
def winner_persistence(prev_load: torch.Tensor, cur_load: torch.Tensor, top: Optional[int] = None) -> torch.Tensor:
    """Fraction of the top-n most-loaded experts in `cur_load` [..., E] that were also top-n in `prev_load`.

    n defaults to 1 (RouterStats.winner_persistence defaults it to top-k). 0 where either load is
    all zero. Ties are broken by torch.topk's order.
    """
    n = top or 1
    if not 1 <= n <= cur_load.shape[-1]:
        raise ValueError(f"top must be in [1, {cur_load.shape[-1]}], got {n}")
    prev_mask = _top_mask(prev_load, n)
    cur_mask = _top_mask(cur_load, n)
    overlap = (prev_mask & cur_mask).sum(dim=-1).float() / n
    valid = (prev_load.sum(dim=-1) > 0) & (cur_load.sum(dim=-1) > 0)
    return torch.where(valid, overlap, torch.zeros_like(overlap))


def _top_mask(load: torch.Tensor, n: int) -> torch.Tensor:
    idx = torch.topk(load, n, dim=-1).indices
    return torch.zeros(load.shape, dtype=torch.bool, device=load.device).scatter(-1, idx, True)
