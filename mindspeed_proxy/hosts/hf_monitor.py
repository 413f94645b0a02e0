"""HFMonitor: the mechanism monitor on a Hugging Face MoE model under data parallelism (DeepSpeed ZeRO or none).

Reuses MechanismMonitor's router family, detectors, failure agreement and sinks; replaces what reads Megatron
modules: the targets (hf_targets.py), the snapshots and the spectral sample. Work is split over the
data-parallel group by layer: layer l is computed by DP rank l mod P, which alone keeps its snapshot; one
SUM over DP of the fixed-shape [L, ...] tables gives every rank all layers. Parameters that ZeRO-3
partitions are gathered one layer at a time through `gather(params)` (a collective, run on every rank outside
the failure guards, the same layers in the same order everywhere); the router weights are gathered together
at a router sample.

DeepSpeed-MoE layers (expert parallelism, `ep_size` > 1): each EP rank computes and snapshots the ΔW of the
sampled experts it holds, for every layer, and those table entries are summed over the expert-parallel group
(the rest over DP, as above); router tokens are summed over DP (each rank routes its own tokens) and the
router records carry `ep_load`, the tokens routed to each EP rank's experts.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist

from mindspeed_proxy.hosts import hf_targets
from mindspeed_proxy.monitor import reductions as R
from mindspeed_proxy.monitor.config import MonitorConfig
from mindspeed_proxy.monitor.monitor import STATISTICS, MechanismMonitor
from mindspeed_proxy.monitor.router import RouterStats
from mindspeed_proxy.monitor.spectral import qk_increment_spectra, update_gram
from mindspeed_proxy.monitor.spectral_family import NSTAT, stats_vector, update_stats
from mindspeed_proxy.monitor.spectral_routes import qk_spectra_rank_tol



def deepspeed_gate_routing(gate, inputs, output) -> tuple:
    """(logits [S, E], bool routing map [S, E]) of one DeepSpeed TopKGate call: the logits recomputed from its
    input as the gate does (fp32, no jitter), the map = the experts each token was dispatched to (after the
    capacity drop; top-2 second-expert sampling included)."""
    logits = torch.nn.functional.linear(inputs[0].detach().float(), gate.wg.weight.detach().float())
    num_experts = logits.shape[-1]
    if len(output) == 7:  # sparse routes: indices [k, S], -1 where the capacity evicted the route
        indices = output[3].long()
        routed = torch.zeros(indices.shape[1], num_experts + 1, dtype=torch.bool, device=logits.device)
        routed.scatter_(1, torch.where(indices >= 0, indices, num_experts).T, True)
        return logits, routed[:, :num_experts]
    return logits, output[2].any(dim=-1)  # dense: dispatch_mask [S, E, C]


def no_gather(params):
    """Parameters are whole on every rank (no ZeRO-3): nothing to gather."""
    return contextlib.nullcontext()


def dp_groups(dp_group=None) -> R.MonitorGroups:
    """MonitorGroups of a data-parallel-only job (no TP/PP/EP): DP = `dp_group` (default: the world)."""
    active = dist.is_available() and dist.is_initialized()
    if not active:
        return R.MonitorGroups()
    group = dp_group if dp_group is not None else dist.group.WORLD
    return R.MonitorGroups(dp=group, world=dist.group.WORLD, dp_rank=dist.get_rank(group),
                           global_rank=dist.get_rank())


class HFMonitor(MechanismMonitor):
    """The mechanism monitor of a transformers MoE model (construct on every rank, same config everywhere)."""

    def __init__(self, config, model: torch.nn.Module, groups: Optional[R.MonitorGroups] = None,
                 gather: Callable = no_gather, tensorboard_writer=None, wandb_writer=None, iteration: int = 0):
        # deliberately not MechanismMonitor.__init__ (it walks Megatron modules); the same state, HF targets
        self.config = config if isinstance(config, MonitorConfig) else MonitorConfig.from_dict(dict(config or {}))
        cfg = self.config
        self.model_chunks = [model]
        self.model_config = model.config
        self.groups = groups or dp_groups()
        self.gather = gather
        self.dp_size = dist.get_world_size(self.groups.dp) if self.groups.dp is not None else 1
        self.targets = hf_targets.collect(model, cfg.update_matrices, cfg.experts_per_layer, cfg.layers)
        if self.targets.ep_group is not None:
            self.groups = dataclasses.replace(self.groups, ep=self.targets.ep_group, ep_size=self.targets.ep_size,
                                              ep_rank=dist.get_rank(self.targets.ep_group))
        self.device = next(model.parameters()).device
        t = self.targets
        self.router_stats = (RouterStats(t.num_layers, t.num_experts, t.topk, device=self.device)
                             if t.num_experts and "router" in cfg.families else None)
        banks = cfg.detector_banks()
        self.spectral_detectors = banks["attention-spectral"]
        self.router_detectors = banks["router"]
        self.rl_detectors = banks["rl"]
        self.snapshots: dict = {}
        self._qk_grams, self._qk_pending = {}, {}  # no Gram reuse on this host (qk_gram_reuse is ignored)
        self.disabled = {f for f in STATISTICS if f not in cfg.families and f != "expert-features"}
        if self.router_stats is None:
            self.disabled.add("router")
        self.expert_features = None  # the converter's expert features: Megatron host only
        self._failures, self._reported = {}, set()
        self._prev_load = None
        self.is_logging_rank = self.groups.global_rank == cfg.log_rank
        self.alerts, self.last = [], {}
        self.provenance_hook_calls, self.gap_cause = 0, None
        self._hooks = [layer.gate.register_forward_hook(self._gate_hook(layer.index, layer.deepspeed_moe))
                       for layer in t.layers if layer.gate is not None] if self.router_stats is not None else []
        self._open_run(tensorboard_writer, wandb_writer, False, None, {
            "type": "config", "config": cfg.to_dict(), "slots": t.slots, "iteration": iteration,
            "num_layers": t.num_layers, "num_heads": t.num_heads, "num_experts": t.num_experts,
            "host": "huggingface", "model_type": t.model_type})
        self._snapshot_taken = False  # the same on every rank (a rank may own no layer, so hold no snapshot)
        if cfg.snapshot_step(iteration):
            self._take_snapshots()

    # ---------------------------------------------------------------- hooks
    def _gate_hook(self, layer: int, deepspeed_moe: bool = False):
        def hook(module, inputs, output):
            if not (module.training and torch.is_grad_enabled()) or "router" in self.disabled:
                return  # training forwards only (no eval / generation passes)
            try:
                if deepspeed_moe:
                    logits, indices = deepspeed_gate_routing(module, inputs, output)
                elif isinstance(output, tuple):
                    logits, indices = output[0], output[2] if len(output) > 2 else None
                else:
                    logits, indices = output, None
                if self.targets.sigmoid:  # softmax(log σ) = σ/Σσ, the normalised affinity
                    logits = torch.nn.functional.logsigmoid(logits.detach().float())
            except Exception:
                self._fail("router")  # agreed over ranks and reported at the next router sample
                return
            self.on_router_logits(layer + 1, logits, indices)
        return hook

    def _mine(self, layer: hf_targets.Layer) -> list:
        """The slots of `layer` this rank computes: all if it owns the layer, else its DeepSpeed-MoE experts."""
        owns = self.owns(layer.index)
        return [s for s in layer.slots if s.expert_parallel or owns]

    def remove_hooks(self) -> None:
        """Detach the router hooks (the model trains on unmonitored)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def owns(self, layer: int) -> bool:
        """Whether this DP rank computes (and snapshots) `layer`."""
        return layer % self.dp_size == self.groups.dp_rank

    # ---------------------------------------------------------------- snapshots
    def _full(self, param: torch.Tensor) -> torch.Tensor:
        return param.detach().float()

    def _take_snapshots(self) -> None:
        self.snapshots = {}
        self._snapshot_taken = True
        device = torch.device("cpu") if self.config.snapshot_on_cpu else None
        for layer in self.targets.layers:
            with self.gather(layer.params()):  # every rank, every layer (a collective), outside the guard
                if self._mine(layer) or (self.owns(layer.index) and layer.attention is not None):
                    try:
                        self._snapshot_layer(layer, device)
                    except Exception:  # no W_{t-δ} for this layer: both spectral families stop, on every rank
                        self._fail("update-spectral")
                        self._fail("attention-spectral")

    def _snapshot_layer(self, layer: hf_targets.Layer, device) -> None:
        for slot in self._mine(layer):
            self.snapshots[("w", layer.index, slot.index)] = slot.read(self._full).to(
                device=device, dtype=torch.float32, copy=True)
        a = layer.attention
        if a is not None and self.owns(layer.index):
            for p in (a.q, a.k, a.q_norm, a.k_norm):
                if p is not None:
                    self.snapshots[("p", layer.index, id(p))] = self._full(p).to(device=device, copy=True)

    # ---------------------------------------------------------------- spectral sample
    def _spectral_step(self, iteration: int) -> None:
        if not self._snapshot_taken:  # no W_{t-δ} yet: the same decision on every rank
            return
        t = self.targets
        terms = self.config.qk_terms
        update_table = torch.zeros(t.num_layers, len(t.slots), NSTAT + 1, device=self.device)
        attn_table = torch.zeros(t.num_layers, t.num_heads, len(terms), NSTAT + 1, device=self.device)
        for layer in t.layers:
            with self.gather(layer.params()):  # every rank, every layer: the gather is a collective
                if "update-spectral" not in self.disabled and self._mine(layer):
                    self._guarded("update-spectral", self._layer_update, layer, update_table)
                if self.owns(layer.index) and "attention-spectral" not in self.disabled \
                        and layer.attention is not None:
                    self._guarded("attention-spectral", self._layer_qk, layer, attn_table)
        self._share_and_publish(iteration, update_table, attn_table, self._reduce_tables)

    def weights_loaded(self) -> None:
        """The weights were replaced (a checkpoint load): retake the snapshots, so no ΔW spans the load."""
        if self._snapshot_taken:
            self._take_snapshots()

    def _reduce_tables(self, flat: torch.Tensor) -> None:
        """SUM the ownership-masked tables over the data-parallel group (layers are split over DP ranks);
        with DeepSpeed-MoE experts, their entries over the expert-parallel group instead."""
        t = self.targets
        if t.ep_group is None:
            if self.dp_size > 1:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.groups.dp)
            return
        experts = torch.zeros(t.num_layers, len(t.slots), NSTAT + 1, dtype=torch.bool, device=flat.device)
        columns = [i for i, name in enumerate(t.slots) if name.startswith("expert")]
        for layer in t.layers:
            if layer.deepspeed_moe:
                experts[layer.index, columns] = True
        mask = torch.zeros_like(flat, dtype=torch.bool)
        mask[:experts.numel()] = experts.view(-1)
        expert_part = torch.where(mask, flat, torch.zeros_like(flat))
        flat.masked_fill_(mask, 0.0)
        if self.dp_size > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.groups.dp)
        dist.all_reduce(expert_part, op=dist.ReduceOp.SUM, group=t.ep_group)
        flat.add_(expert_part)  # disjoint supports: exact

    def _layer_update(self, layer: hf_targets.Layer, table: torch.Tensor) -> None:
        for slot in self._mine(layer):
            current = slot.read(self._full)
            delta = current - self.snapshots[("w", layer.index, slot.index)].to(current.device)
            table[layer.index, slot.index, :NSTAT] = update_stats(update_gram(delta, None))
            table[layer.index, slot.index, NSTAT] = 1.0

    def _layer_qk(self, layer: hf_targets.Layer, table: torch.Tensor) -> None:
        a = layer.attention
        params = [p for p in (a.q, a.k, a.q_norm, a.k_norm) if p is not None]
        new = {p: self._full(p) for p in params}
        old = {p: self.snapshots[("p", layer.index, id(p))].to(self.device) for p in params}
        wq_new, wk_new = hf_targets.qk_blocks(new, a)
        wq_old, wk_old = hf_targets.qk_blocks(old, a)
        heads = torch.arange(a.num_heads, device=self.device)
        if self.config.heads is not None:
            keep = torch.tensor([h in self.config.heads for h in range(a.num_heads)], device=self.device)
            heads = heads[keep]
            wq_old, wq_new = (x.flatten(0, 1)[keep] for x in (wq_old, wq_new))
            rep = a.num_heads // a.num_kv
            wk_old, wk_new = (x.expand(-1, rep, -1, -1).flatten(0, 1)[keep] for x in (wk_old, wk_new))
        sigmas, _ = qk_increment_spectra(wq_old, wk_old, wq_new, wk_new, self.config.qk_terms)
        for ti, term in enumerate(self.config.qk_terms):
            sigma, d = sigmas[term].flatten(0, -2), wq_new.shape[-2]
            tol = qk_spectra_rank_tol(d, wq_new.shape[-1], sigma.dtype, term)
            table[layer.index, heads, ti, :NSTAT] = stats_vector(sigma, d, tol)
            table[layer.index, heads, ti, NSTAT] = 1.0

    # ---------------------------------------------------------------- router family
    def _router_step(self, iteration: int) -> None:
        gates = [g.weight for g in self.targets.routers.values()]
        with self.gather(gates):  # router weights of every layer at once ([E, H] each)
            super()._router_step(iteration)

    def _publish(self, family, iteration, records, per_layer, bank, relabel=None, window_steps=None) -> None:
        if family == "router" and self.groups.ep_size > 1:  # tokens routed to each EP rank's experts
            for layer, rec in records.items():
                ep_load = torch.tensor(rec["load"]).view(self.groups.ep_size, -1).sum(dim=-1).tolist()
                rec["ep_load"] = ep_load
        super()._publish(family, iteration, records, per_layer, bank, relabel, window_steps)

    def close(self) -> None:
        """Close the sinks, drop the snapshots and detach the router hooks."""
        super().close()
        self.remove_hooks()
