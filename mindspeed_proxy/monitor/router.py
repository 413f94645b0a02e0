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
        self._pending: list = []  # (layer, fp32 logits [n, E], expert ids [n·k] / routing map [n, E] / None)
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
        chosen = None
        if topk_indices is not None:
            chosen = (topk_indices.detach().reshape(-1, num_experts).clone() if topk_indices.dtype == torch.bool
                      else topk_indices.detach().reshape(-1).long())  # .long() copies an int32/int16 tensor
            if chosen.data_ptr() == topk_indices.data_ptr():
                chosen = chosen.clone()
        nbytes = flat.shape[0] * num_experts * 4
        if nbytes >= self.pending_bytes:  # a large call: folded in at once, without a copy of its logits
            self.flush()
            self._fold([(layer_index, flat, chosen)])
            return
        self._pending.append((layer_index, flat.to(torch.float32, copy=True), chosen))
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
        num_layers, num_experts, k = self.num_layers, self.num_experts, self.topk
        width = min(k + 1, num_experts)
        device = self._buffer.device

        def small(values, dtype=torch.long):  # host lists to the device without waiting on its stream
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        counts = [c[1].shape[0] for c in calls]
        logits = torch.cat([c[1] for c in calls]) if len(calls) > 1 else calls[0][1]
        rows = logits.shape[0]
        row_layer = torch.repeat_interleave(small([c[0] for c in calls]), small(counts), output_size=rows)
        entropy = torch.empty(rows, dtype=torch.float64, device=device)
        margin = torch.zeros(rows, dtype=torch.float64, device=device)
        derive = [c[2] is None for c in calls]
        keys = []
        for start in range(0, rows, self.chunk_size):
            chunk = logits[start:start + self.chunk_size].float()
            n = chunk.shape[0]
            # the experts along dim 0: a softmax over a short last dim runs a slow per-token loop;
            # entr() gives 0·log 0 = 0 for −inf logits and keeps NaN
            torch.sum(torch.special.entr(torch.softmax(chunk.T.contiguous(), dim=0)), dim=0, out=entropy[start:start + n])
            top = torch.topk(chunk, width, dim=-1, sorted=True)
            if width > k:
                torch.sub(top.values[:, k - 1], top.values[:, k], out=margin[start:start + n])
            if any(derive):
                keys.append(row_layer[start:start + n, None] * num_experts + top.indices[:, :k])
        owner = torch.zeros(num_layers, len(calls), dtype=torch.float64, device=device)
        owner[small([c[0] for c in calls]), torch.arange(len(calls), device=device)] = 1.0
        ends = small(counts).cumsum(0) - 1

        def per_call(values):  # [rows, m] -> [calls, m] sums of each call's rows, from float64 running sums
            sums = values.cumsum(0, dtype=torch.float64)[ends]
            sums[1:] -= sums[:-1].clone()
            return sums

        token_sums = torch.cat([small(counts, torch.float64)[:, None], per_call(torch.stack([entropy, margin], 1))], 1)
        self._buffer[:, :_LOAD] += (owner @ token_sums).float()
        load = torch.zeros(num_layers * num_experts, dtype=torch.float32, device=device)
        if keys:
            weight = torch.repeat_interleave(small(derive, torch.float32), small(counts), output_size=rows)
            load += torch.bincount(torch.cat(keys).reshape(-1), weights=weight[:, None].expand(rows, k).reshape(-1),
                                   minlength=num_layers * num_experts).float()
        ids = [(c[0], c[2]) for c in calls if c[2] is not None and c[2].dtype != torch.bool]
        if ids:
            load += torch.bincount(torch.cat([layer * num_experts + chosen for layer, chosen in ids]),
                                   minlength=num_layers * num_experts).float()
        maps = [c[2] if c[2] is not None and c[2].dtype == torch.bool else None for c in calls]
        if any(m is not None for m in maps):
            filled = torch.cat([m if m is not None else torch.zeros(n, num_experts, dtype=torch.bool, device=device)
                                for m, n in zip(maps, counts)])
            load += (owner @ per_call(filled)).float().view(-1)
        self._buffer[:, _LOAD:] += load.view(num_layers, num_experts)

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
