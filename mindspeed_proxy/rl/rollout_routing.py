"""The experts an inference engine chose per generated token, matched to the training batch's rows (torch only).

An engine runs many requests in one flattened forward; for each of its tokens it knows the request and the
position in that request. `RolloutRouting` keeps, per request, the token and the top-k experts of every MoE
layer at each position it ran; `lookup(rows)` gives a training batch's rows [B, S] the experts of the request
whose tokens they start with ([B, S, L, k], the engine layout of `observe.RolloutObserver`) and which
positions have one. Rows with equal tokens get the same (first) request, so a replay and the statistics that
check it read one table. `TrainRouting` collects the training passes' experts in the same layout.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def topk_of(routing_map: torch.Tensor, k: int) -> torch.Tensor:
    """[N, E] bool routing map to [N, k] int64 expert ids (the chosen experts, ascending)."""
    chosen = torch.sort(routing_map.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :k]
    return torch.sort(chosen, dim=1).values.to(torch.int64)


class RolloutRouting:
    """Experts the engine chose, per (rank, request): {position: token}, {layer number: {position: ids}} and
    {layer number: {position: their routing probabilities}} (when recorded)."""

    def __init__(self):
        self.requests: dict = {}
        self.layers: set = set()

    def record(self, layer: int, request_ids: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
               experts: torch.Tensor, rank: int = 0, probs: Optional[torch.Tensor] = None) -> None:
        """One layer's top-k `experts` [n, k] (and their `probs`) of the n tokens of one engine step (request,
        position, token)."""
        self.layers.add(int(layer))
        weights = probs.detach().float().cpu().tolist() if probs is not None else [None] * len(experts)
        for rid, pos, tok, ids, w in zip(request_ids.tolist(), positions.tolist(), tokens.tolist(),
                                         experts.detach().cpu().tolist(), weights):
            entry = self.requests.setdefault((rank, rid), ({}, {}, {}))
            entry[0][pos] = tok
            entry[1].setdefault(int(layer), {})[pos] = ids
            if w is not None:
                entry[2].setdefault(int(layer), {})[pos] = w

    def gather(self, group=None) -> "RolloutRouting":
        """This table merged with every rank's of `group` (all_gather_object; a collective on every rank)."""
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return self
        tables = [None] * dist.get_world_size(group)
        dist.all_gather_object(tables, (self.requests, sorted(self.layers)), group=group)
        merged = RolloutRouting()
        for requests, layers in tables:
            merged.layers.update(layers)
            for key, parts in requests.items():
                entry = merged.requests.setdefault(key, ({}, {}, {}))
                entry[0].update(parts[0])
                for into, per_layer in zip(entry[1:], parts[1:]):
                    for layer, values in per_layer.items():
                        into.setdefault(layer, {}).update(values)
        return merged

    def _by_prefix(self) -> dict:
        """{token tuple of positions 0..n-1: request} for requests whose positions are contiguous from 0."""
        out = {}
        for key in sorted(self.requests, key=lambda k: (k[1], k[0])):
            tokens = self.requests[key][0]
            prefix = tuple(tokens[p] for p in range(len(tokens)) if p in tokens)
            if len(prefix) == len(tokens):
                out.setdefault(prefix, key)
        return out

    def lookup(self, rows: torch.Tensor, layers: Optional[list] = None, top_k: Optional[int] = None,
               with_probs: bool = False):
        """(experts [B, S, L, k] int64, recorded [B, S] bool[, probs [B, S, L, k] float32]) for `rows` [B, S] over
        `layers` (default: all recorded, ascending); a row no request starts, or a position the engine did not run
        (or ran without probabilities, with `with_probs`), is not recorded (zeros there)."""
        layers = sorted(self.layers) if layers is None else list(layers)
        batch, seq = rows.shape
        if top_k is None:
            top_k = next((len(ids) for parts in self.requests.values() for d in parts[1].values()
                          for ids in d.values()), 1)
        experts = torch.zeros(batch, seq, len(layers), top_k, dtype=torch.int64)
        probs = torch.zeros(batch, seq, len(layers), top_k, dtype=torch.float32)
        recorded = torch.zeros(batch, seq, dtype=torch.bool)
        index = self._by_prefix()
        lengths = sorted({len(p) for p in index}, reverse=True)
        for b, row in enumerate(rows.tolist()):
            key = next((index[tuple(row[:n])] for n in lengths if n <= seq and tuple(row[:n]) in index), None)
            if key is None:
                continue
            _, per_layer, per_layer_probs = self.requests[key]
            for pos in range(min(seq, len(self.requests[key][0]))):
                if all(pos in per_layer.get(layer, {}) for layer in layers) and (not with_probs or all(
                        pos in per_layer_probs.get(layer, {}) for layer in layers)):
                    recorded[b, pos] = True
                    experts[b, pos] = torch.tensor([per_layer[layer][pos] for layer in layers])
                    if with_probs:
                        probs[b, pos] = torch.tensor([per_layer_probs[layer][pos] for layer in layers])
        return (experts, recorded, probs) if with_probs else (experts, recorded)


def forward_fill(experts: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """experts [B, S, L, k] where every unrecorded position takes the last recorded one before it (the first
    recorded one at the start of a row; a row without any keeps its values)."""
    out = experts.clone()
    for b in range(experts.shape[0]):
        known = recorded[b].nonzero().flatten().tolist()
        if not known:
            continue
        last = known[0]
        for pos in range(experts.shape[1]):
            if recorded[b, pos]:
                last = pos
            else:
                out[b, pos] = experts[b, last]
    return out


def engine_to_router_order(experts: torch.Tensor) -> torch.Tensor:
    """[B, S, L, k] to megatron-core's per-forward router order [L, S·B, k] (token s·B + b)."""
    batch, seq, layers, k = experts.shape
    return experts.permute(2, 1, 0, 3).reshape(layers, seq * batch, k).contiguous()


class TrainRouting:
    """The experts of training-side forwards, forward by forward: `begin(B, S)`, `add(layer, [S·B, k])` per MoE
    layer, `end()`; `take()` gives [B_total, S, L, k] (None if a forward was incomplete or none ran)."""

    def __init__(self):
        self.forwards: list = []
        self.current: Optional[dict] = None
        self.shape = (0, 0)
        self.broken = False
        self.seen_layers: list = []

    def begin(self, batch: int, seq: int) -> None:
        """A forward of a [batch, seq] batch starts."""
        self.current, self.shape = {}, (batch, seq)

    def add(self, layer: int, experts: torch.Tensor) -> None:
        """One MoE layer's experts of the current forward, in router order (ignored outside a forward)."""
        if self.current is None:
            return
        batch, seq = self.shape
        if experts.shape[0] != batch * seq:  # sequence-parallel shards or dropped tokens: not comparable
            self.broken = True
            return
        self.current[int(layer)] = experts.detach().cpu().view(seq, batch, -1)

    def end(self) -> None:
        """The current forward finished."""
        if self.current is not None:
            if not self.current:
                self.broken = True
            else:
                self.seen_layers = sorted(self.current)
                per_layer = [self.current[k] for k in self.seen_layers]
                self.forwards.append(torch.stack(per_layer).permute(2, 1, 0, 3))
        self.current = None

    def take(self) -> tuple:
        """([B_total, S, L, k] of every forward so far, or None; their MoE layer numbers); resets."""
        out = None if self.broken or not self.forwards else torch.cat(self.forwards)
        layers = self.seen_layers
        self.__init__()
        return out, layers
