"""MechanismMonitor: samples the three families during training, reduces them, detects, writes sinks.

Hook → statistics → reduction → detector → sink. The monitor is observation only (no gradient, no
weight is touched) and never raises into training: each statistic computes inside its own guard, the
collectives run outside the guards with fixed shapes on every rank, and failure flags are agreed over
the world so a failing statistic is disabled on every rank at the same step and reported once.
"""
from __future__ import annotations

import logging
import traceback
from typing import Optional

import torch

from mindspeed_proxy.monitor import reductions as R
from mindspeed_proxy.monitor.config import STAT_NAMES, MonitorConfig
from mindspeed_proxy.monitor.detectors import DetectorBank
from mindspeed_proxy.monitor.expert_features import ExpertFeatureCollector
from mindspeed_proxy.monitor.mla_layout import (
    TP_GATHERED,
    attention_terms,
    mla_increment_singular_values,
    mla_layout_of,
    mla_qk_blocks,
    mla_read,
    sharded_rows,
)
from mindspeed_proxy.monitor.qk_layout import group_shared_keys, layernorm_scale, layout_of, qk_blocks
from mindspeed_proxy.monitor.router import RouterStats, router_weight_stats, winner_persistence
from mindspeed_proxy.monitor.sinks import build_sinks, scalar_tags
from mindspeed_proxy.monitor.spectral import (
    qk_increment_spectra,
    singular_values_from_gram,
    spectral_stats,
    update_gram,
)
from mindspeed_proxy.monitor.targets import collect

logger = logging.getLogger(__name__)

STATISTICS = ("router", "attention-spectral", "update-spectral", "expert-features")
ROUTER_WEIGHT_KEYS = ("similarity", "conditioning_ratio", "row_norm_mean", "row_norm_max")
ROUTER_SUMMARY_KEYS = ("entropy", "normalized_entropy", "load_entropy", "normalized_load_entropy",
                       "max_over_mean", "dead_experts", "overload", "margin")
NSTAT = len(STAT_NAMES)


def _model_config(chunk):
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk.config


def _stats_vector(sigma: torch.Tensor, matrix_dim: int, from_gram: bool = False) -> torch.Tensor:
    # σ from a Gram's eigenvalues carry an absolute error ~eps·σ_max², i.e. values below
    # sqrt(n·eps)·σ_max are noise: count the numerical rank above that floor, not SVD's n·eps.
    tol = (matrix_dim * torch.finfo(sigma.dtype).eps) ** 0.5 if from_gram else None
    stats = spectral_stats(sigma, matrix_dim=matrix_dim, rank_tol=tol)
    return torch.stack([stats[name] for name in STAT_NAMES], dim=-1).float()


class MechanismMonitor:
    """The mechanism monitor of one training job (construct on every rank, same config everywhere)."""

    def __init__(self, config, model, optimizer=None, process_groups: Optional[R.MonitorGroups] = None,
                 tensorboard_writer=None, wandb_writer=None, iteration: int = 0):
        self.config = config if isinstance(config, MonitorConfig) else MonitorConfig.from_dict(dict(config or {}))
        self.model_chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.groups = process_groups or R.MonitorGroups.from_parallel_state()
        self.model_config = _model_config(self.model_chunks[0])
        cfg = self.config
        self.targets = collect(self.model_chunks, self.model_config, cfg.update_matrices, cfg.experts_per_layer,
                               optimizer=optimizer, layers=cfg.layers)
        self.device = next(self.model_chunks[0].parameters()).device
        t = self.targets
        self.router_stats = (RouterStats(t.num_layers, t.num_experts, t.topk, device=self.device)
                             if t.num_experts and "router" in cfg.families else None)
        self.spectral_detectors = DetectorBank(config=cfg.detector)
        self.router_detectors = DetectorBank(config=cfg.router_detector)
        self.rl_detectors = DetectorBank(config=cfg.rl_detector, metric_configs=cfg.rl_detector_configs())
        self.snapshots: dict[tuple, torch.Tensor] = {}
        # per layer: ((Wq'ᵀWq', Wk'ᵀWk'), reuses so far) of the weights the current snapshot holds
        self._qk_grams: dict[int, tuple] = {}
        self._qk_pending: dict[int, tuple] = {}
        self.disabled: set[str] = {f for f in STATISTICS if f not in cfg.families and f != "expert-features"}
        if self.router_stats is None:
            self.disabled.add("router")
        self.expert_features = (ExpertFeatureCollector(t.num_layers, t.num_experts, self.model_config.hidden_size,
                                                       self.groups, self.device)
                                if t.num_experts and cfg.expert_features else None)  # None: off, not "disabled"
        self._failures: dict[str, str] = {}
        self._reported: set[str] = set()
        self._prev_load: Optional[torch.Tensor] = None
        self.is_logging_rank = self.groups.global_rank == cfg.log_rank
        self.sinks = build_sinks(cfg.sinks, cfg.output_dir, tensorboard_writer, wandb_writer) \
            if self.is_logging_rank else []
        self.alerts: list = []
        self.last: dict[str, dict] = {}
        self._emit({"type": "config", "config": cfg.to_dict(), "slots": t.slots, "iteration": iteration,
                    "num_layers": t.num_layers, "num_heads": t.num_heads, "num_experts": t.num_experts})
        if cfg.snapshot_step(iteration):  # e.g. δ = interval: the first ΔW spans steps 0..interval
            self._take_snapshots()

    # ---------------------------------------------------------------- hooks
    @property
    def wants_moe_input(self) -> bool:
        """Whether the MoE-layer input hook has anything to do (the expert-feature collector is on)."""
        features = self.expert_features
        return features is not None and not features.written and "expert-features" not in self.disabled

    def on_moe_input(self, module, hidden_states: torch.Tensor, step: int) -> None:
        """One training forward of a MoE layer at optimizer step `step`: collect expert features when due."""
        if not self.wants_moe_input or not self.config.expert_features_step(step):
            return
        try:
            self.expert_features.collect(module, hidden_states, step, "expert-features" in self._failures)
        except Exception:
            self._fail("expert-features")

    def on_router_logits(self, layer_number: int, logits: torch.Tensor, topk_indices=None) -> None:
        """Accumulate one router call: logits [tokens, E] before top-k, selected experts or routing map."""
        features = self.expert_features
        if features is not None and features.armed == layer_number and topk_indices is not None:
            try:
                features.count_routed(layer_number, topk_indices)
            except Exception:
                self._fail("expert-features")
        if "router" in self.disabled or self.router_stats is None:
            return
        try:
            self.router_stats.update(layer_number - 1, logits.detach(),
                                     None if topk_indices is None else topk_indices.detach())
        except Exception:
            self._fail("router")

    def after_optimizer_step(self, iteration: int) -> None:
        """Run what is due after a successful optimizer step `iteration` (1-based, Megatron's count)."""
        try:
            cfg = self.config
            ran = False
            if "router" not in self.disabled and iteration % cfg.router_interval == 0:
                self._router_step(iteration)
                ran = True
            spectral_due = cfg.sample_step(iteration) and not {"attention-spectral", "update-spectral"} <= self.disabled
            if spectral_due:
                self._qk_pending = {}
                self._spectral_step(iteration)
            if cfg.snapshot_step(iteration):
                self._take_snapshots()
                if spectral_due:  # δ = interval: the new snapshot holds the weights just sampled
                    self._qk_grams = self._qk_pending
            features_due = cfg.expert_features_step(iteration) and self.wants_moe_input
            if (spectral_due or cfg.snapshot_step(iteration) or features_due) and not ran:
                self._agree(None)
            if features_due and iteration == cfg.expert_features_end():
                self._write_expert_features()
        except Exception:  # last resort: a collective failed; stop everything rather than training
            self._fail("monitor")
            self.disabled.update(STATISTICS)
            self._report()

    # ---------------------------------------------------------------- failures
    def _fail(self, statistic: str) -> None:
        self._failures.setdefault(statistic, traceback.format_exc())

    def _flags(self) -> torch.Tensor:
        return torch.tensor([1.0 if s in self._failures else 0.0 for s in STATISTICS], device=self.device)

    def _agree(self, summed_flags: Optional[torch.Tensor]) -> None:
        """Disable every statistic that failed on any rank (flags already world-summed, or agree now)."""
        flags = summed_flags if summed_flags is not None else R.agree_on_failures(self._flags(), self.groups)
        for name, flag in zip(STATISTICS, flags.tolist()):
            if flag > 0 and name not in self.disabled:
                self.disabled.add(name)
                self._failures.setdefault(name, "failed on another rank")
        self._report()

    def _report(self) -> None:
        for name, trace in self._failures.items():
            if name in self._reported:
                continue
            self._reported.add(name)
            logger.error("mechanism monitor: statistic %r disabled after an exception on rank %d:\n%s",
                         name, self.groups.global_rank, trace)
            self._emit({"type": "monitor-error", "statistic": name, "rank": self.groups.global_rank,
                        "traceback": trace})

    # ---------------------------------------------------------------- router family
    def _router_step(self, iteration: int) -> None:
        stats, t, g = self.router_stats, self.targets, self.groups
        weights = torch.zeros(t.num_layers, len(ROUTER_WEIGHT_KEYS) + 1, device=self.device)
        owner = g.tp_rank == 0 and g.dp_rank == 0 and g.cp_rank == 0
        try:
            if owner:
                for layer, router in t.routers.items():
                    ws = router_weight_stats(router.weight.detach())
                    weights[layer, :-1] = torch.stack([ws[k] for k in ROUTER_WEIGHT_KEYS]).float()
                    weights[layer, -1] = 1.0
        except Exception:
            self._fail("router")
        flat = torch.cat([stats.as_tensor(), weights.view(-1), self._flags()])
        R.reduce_router_tokens(flat, g)
        n_tok = stats.as_tensor().numel()
        stats.as_tensor().copy_(flat[:n_tok])
        weights = flat[n_tok:n_tok + weights.numel()].view_as(weights)
        self._agree(flat[-len(STATISTICS):])
        if "router" in self.disabled:
            stats.reset()
            return
        try:
            summary = stats.summary(ep_size=g.ep_size)
            load = summary["load"]
            persistence = (winner_persistence(self._prev_load, load, top=t.topk)
                           if self._prev_load is not None else None)
            self._prev_load = load.clone()
            per_layer: dict[str, dict[int, float]] = {}
            records = {}
            host = {k: summary[k].tolist() for k in ROUTER_SUMMARY_KEYS + ("tokens",)}
            wh = weights.tolist()
            pers = persistence.tolist() if persistence is not None else None
            for layer in range(t.num_layers):
                if host["tokens"][layer] <= 0 and wh[layer][-1] <= 0:
                    continue
                rec = {k: host[k][layer] for k in ROUTER_SUMMARY_KEYS + ("tokens",)}
                rec.update({k: wh[layer][i] for i, k in enumerate(ROUTER_WEIGHT_KEYS)})
                if pers is not None:
                    rec["winner_persistence"] = pers[layer]
                rec["load"] = load[layer].tolist()
                records[layer] = rec
                for metric, value in rec.items():
                    if metric != "load":
                        per_layer.setdefault(metric, {})[layer] = value
            self._publish("router", iteration, records, per_layer, self.router_detectors)
        except Exception:
            self._fail("router")
        stats.reset()

    # ---------------------------------------------------------------- spectral families
    def _take_snapshots(self) -> None:
        self._qk_grams = {}  # Grams of the previous snapshot's blocks; after_optimizer_step may set new ones
        target_device = torch.device("cpu") if self.config.snapshot_on_cpu else None
        for w in self.targets.weights:
            self.snapshots[("w", w.layer, w.slot)] = w.read().detach().to(device=target_device,
                                                                           dtype=torch.float32, copy=True)
        for a in self.targets.attention:
            if a.mla:  # MLA: every projection and latent-norm scale (mla_layout)
                zc = self.model_config.layernorm_zero_centered_gamma
                for name, value in mla_read(a.mla, a.module, zc).items():
                    self.snapshots[("mla", a.layer, name)] = value.detach().to(device=target_device,
                                                                             dtype=torch.float32, copy=True)
                continue
            for name, mod in (("q", a.module.q_layernorm), ("k", a.module.k_layernorm)):
                scale = layernorm_scale(mod, self.model_config.layernorm_zero_centered_gamma)
                if scale is not None:
                    self.snapshots[(name, a.layer)] = scale.detach().to(device=target_device,
                                                                        dtype=torch.float32, copy=True)
            if ("w", a.layer, 0) not in self.snapshots:
                self.snapshots[("w", a.layer, 0)] = a.read_qkv().detach().to(
                    device=target_device, dtype=torch.float32, copy=True)

    def weights_loaded(self) -> None:
        """The weights were replaced (a checkpoint load): retake the snapshots held, so no ΔW spans the load."""
        if self.snapshots:
            self._take_snapshots()

    def bytes_held(self) -> int:
        """Bytes of the fp32 weight snapshots this rank holds."""
        return sum(s.numel() * s.element_size() for s in self.snapshots.values())

    def _spectral_step(self, iteration: int) -> None:
        if not self.snapshots:  # no W_{t-δ} yet (monitor started or resumed mid-interval): same on all ranks
            return
        t, g, cfg = self.targets, self.groups, self.config
        terms = cfg.qk_terms
        update_table = torch.zeros(t.num_layers, len(t.slots), NSTAT + 1, device=self.device)
        attn_table = torch.zeros(t.num_layers, t.num_heads, len(attention_terms(terms, self.model_config)),
                                 NSTAT + 1, device=self.device)
        if "update-spectral" not in self.disabled:
            self._update_spectra(update_table)
        if "attention-spectral" not in self.disabled:
            self._attention_spectra(attn_table)
        flat = torch.cat([update_table.view(-1), attn_table.view(-1)])
        R.share_model_table(flat, g)
        update_table = flat[:update_table.numel()].view_as(update_table)
        attn_table = flat[update_table.numel():].view_as(attn_table)
        self._agree(None)
        if "update-spectral" not in self.disabled:
            self._guarded("update-spectral", self._publish_update, iteration, update_table)
        if "attention-spectral" not in self.disabled:
            self._guarded("attention-spectral", self._publish_attention, iteration, attn_table)

    def _guarded(self, statistic: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:
            self._fail(statistic)

    def _update_spectra(self, table: torch.Tensor) -> None:
        g = self.groups
        grams = {"tp": [], "etp": [], None: []}
        entries = []
        for w in self.targets.weights:
            snap = self.snapshots.get(("w", w.layer, w.slot))
            try:
                current = w.read().detach().float()
                delta = current - snap.to(current.device)
                gram = update_gram(delta, w.parallel_mode)
            except Exception:
                self._fail("update-spectral")
                shape = self._gram_shape(w)
                gram = torch.zeros(shape, device=self.device)
            key = None if w.parallel_mode is None else ("etp" if w.expert_parallel else "tp")
            grams[key].append(gram)
            entries.append((w, gram, key))
        R.all_reduce_grams(grams["tp"], g.tp)
        R.all_reduce_grams(grams["etp"], g.etp)
        try:
            for w, gram, _ in entries:
                owned = (g.etp_rank == 0) if w.expert_parallel else g.owns_replicated
                if not owned:
                    continue
                sigma = singular_values_from_gram(gram)
                table[w.layer, w.slot, :NSTAT] = _stats_vector(sigma, gram.shape[-1], from_gram=True)
                table[w.layer, w.slot, NSTAT] = 1.0
        except Exception:
            self._fail("update-spectral")

    def _gram_shape(self, w) -> tuple:
        out_dim, in_dim = w.read().shape
        side = in_dim if w.parallel_mode == "column" or (w.parallel_mode is None and in_dim <= out_dim) else out_dim
        return (side, side)

    def _attention_spectra(self, table: torch.Tensor) -> None:
        g, terms = self.groups, self.config.qk_terms
        heads_filter = self.config.heads
        for a in self.targets.attention:
            if a.mla:
                self._mla_spectra(a, table)
                continue
            layout = layout_of(a.module)
            weight = a.read_qkv().detach()
            snap = self.snapshots.get(("w", a.layer, 0))
            if layout.needs_full_weight:  # collectives stay outside the guard, fixed shapes
                weight = R.gather_tp(weight.float(), g)
                snap = R.gather_tp(snap.to(weight.device) if snap is not None else torch.zeros_like(
                    a.module.linear_qkv.weight, dtype=torch.float32), g)
            try:
                zc = self.model_config.layernorm_zero_centered_gamma
                q_new = layernorm_scale(a.module.q_layernorm, zc)
                k_new = layernorm_scale(a.module.k_layernorm, zc)
                wq_new, wk_new = qk_blocks(weight.float(), layout, q_new, k_new)
                wq_old, wk_old = qk_blocks(snap.to(weight.device).float(), layout,
                                           self.snapshots.get(("q", a.layer)), self.snapshots.get(("k", a.layer)))
                heads = torch.tensor(layout.local_heads(), device=self.device)
                if heads_filter is not None:
                    keep = torch.tensor([h in heads_filter for h in layout.local_heads()], device=self.device)
                    heads, wq_new, wk_new, wq_old, wk_old = (x[keep] for x in (heads, wq_new, wk_new, wq_old, wk_old))
                if not R.head_owner(g):
                    continue
                blocks = (wq_old, wk_old, wq_new, wk_new)
                if heads_filter is None:  # GQA: one key block (and key Gram) per group
                    blocks = group_shared_keys(*blocks, layout)
                cached = self._qk_grams.get(a.layer)
                reuse = cached is not None and cached[1] < self.config.qk_gram_reuse
                sigmas, grams = qk_increment_spectra(*blocks, terms, cached[0] if reuse else None)
                self._qk_pending[a.layer] = (grams, cached[1] + 1 if reuse else 0)
                for ti, term in enumerate(terms):
                    sigma = sigmas[term].flatten(0, -2)
                    table[a.layer, heads, ti, :NSTAT] = _stats_vector(sigma, weight.shape[-1])
                    table[a.layer, heads, ti, NSTAT] = 1.0
            except Exception:
                self._fail("attention-spectral")

    def _mla_spectra(self, a, table: torch.Tensor) -> None:
        """Content and RoPE QK-increment spectra of one MLA layer (mla_layout); RoPE terms after the content ones."""
        g, terms, zc = self.groups, self.config.qk_terms, self.model_config.layernorm_zero_centered_gamma
        layout = mla_layout_of(a.module)
        new = {k: v.detach().float() for k, v in mla_read(a.mla, a.module, zc).items()}
        old = {k: self.snapshots.get(("mla", a.layer, k)) for k in new}
        for k in TP_GATHERED:  # latent rows split over TP: all-gather, outside the guard, fixed shapes
            if k in new and sharded_rows(k, new[k], layout):
                snap = old[k].to(new[k].device) if old[k] is not None else torch.zeros_like(new[k])
                new[k], old[k] = R.gather_tp(new[k], g), R.gather_tp(snap, g)
        try:
            local = layout.local_heads()
            keep = [i for i, h in enumerate(local) if self.config.heads is None or h in self.config.heads]
            if not R.head_owner(g) or not keep:
                return
            old = {k: v.to(self.device) for k, v in old.items()}
            parts = mla_qk_blocks(old, new, layout, torch.tensor(keep, device=self.device))
            heads = torch.tensor([local[i] for i in keep], device=self.device)
            for pi, part in enumerate(("content", "rope")):
                for ti, term in enumerate(terms):
                    sigma = mla_increment_singular_values(*parts[part], term=term)
                    col = pi * len(terms) + ti
                    table[a.layer, heads, col, :NSTAT] = _stats_vector(sigma, self.model_config.hidden_size)
                    table[a.layer, heads, col, NSTAT] = 1.0
        except Exception:
            self._fail("attention-spectral")

    def _publish_update(self, iteration: int, table: torch.Tensor) -> None:
        host = table.tolist()
        records, per_layer = {}, {}
        for layer, rows in enumerate(host):
            rec = {self.targets.slots[s]: dict(zip(STAT_NAMES, row[:NSTAT]))
                   for s, row in enumerate(rows) if row[NSTAT] > 0}
            if rec:
                records[layer] = rec
                for slot, stats in rec.items():
                    for stat, value in stats.items():
                        per_layer.setdefault(f"{slot}/{stat}", {})[layer] = value
        self._publish("update-spectral", iteration, records, per_layer, self.spectral_detectors)

    def _publish_attention(self, iteration: int, table: torch.Tensor) -> None:
        present = table[..., NSTAT] > 0  # [L, H, T]
        counts = present.sum(dim=1).clamp_min(1)
        means = (table[..., :NSTAT] * present.unsqueeze(-1)).sum(dim=1) / counts.unsqueeze(-1)  # [L, T, S]
        any_layer = present.any(dim=(1, 2)).tolist()
        records, per_layer = {}, {}
        host_means = means.tolist()
        host_heads = table.tolist() if self.config.per_head_records else None
        for layer, has in enumerate(any_layer):
            if not has:
                continue
            rec = {}
            for ti, term in enumerate(attention_terms(self.config.qk_terms, self.model_config)):
                rec[term] = {"mean": dict(zip(STAT_NAMES, host_means[layer][ti]))}
                if host_heads is not None:
                    rec[term]["heads"] = {h: dict(zip(STAT_NAMES, host_heads[layer][h][ti][:NSTAT]))
                                          for h in range(self.targets.num_heads) if host_heads[layer][h][ti][NSTAT] > 0}
                for stat, value in rec[term]["mean"].items():
                    per_layer.setdefault(f"{term}/{stat}", {})[layer] = value
            records[layer] = rec
        self._publish("attention-spectral", iteration, records, per_layer, self.spectral_detectors)

    # ---------------------------------------------------------------- rl family
    def on_rl_step(self, iteration: int, per_layer: dict) -> None:
        """Detect on one RL step's metrics ({metric: {layer or None: value}}, already equal on every rank).

        Called by the RL loop after its own reductions, so it runs no collective; an exception
        disables the rl family on this rank (every rank sees the same values and fails alike)."""
        if "rl" in self.disabled or "rl" not in self.config.families:
            return
        try:
            records = {}
            for metric, layers in per_layer.items():
                for layer, value in layers.items():
                    records.setdefault("all" if layer is None else layer, {})[metric] = value
            self._publish("rl", iteration, records, per_layer, self.rl_detectors)
        except Exception:
            self._fail("rl")
            self.disabled.add("rl")
            self._report()

    # ---------------------------------------------------------------- detection and sinks
    def _publish(self, family, iteration, records, per_layer, bank: DetectorBank) -> None:
        self.last[family] = {"step": iteration, "layers": records}
        series = self.config.detection_series(family, per_layer)
        alerts = bank.update_many(iteration, series) if iteration >= self.config.detect_start else []
        self.alerts.extend(alerts)
        self._emit({"type": "sample", "family": family, "step": iteration, "layers": records})
        for alert in alerts:
            self._emit({"type": "alert", **alert.to_dict()})
        tags = scalar_tags(family, per_layer)
        for sink in self.sinks:
            sink.scalars(iteration, tags)

    def log_record(self, record: dict) -> None:
        """Write a caller's record (e.g. the injected faults) to the sinks of the logging rank."""
        self._emit(record)

    def _emit(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Detector state, disabled statistics and the last router load (snapshots are not saved)."""
        return {"version": 1, "spectral_detectors": self.spectral_detectors.state_dict(),
                "router_detectors": self.router_detectors.state_dict(),
                "rl_detectors": self.rl_detectors.state_dict(), "disabled": sorted(self.disabled),
                "prev_load": None if self._prev_load is None else self._prev_load.tolist()}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output (the next ΔW sample waits for a fresh snapshot)."""
        self.spectral_detectors.load_state_dict(state["spectral_detectors"])
        self.router_detectors.load_state_dict(state["router_detectors"])
        if "rl_detectors" in state:
            self.rl_detectors.load_state_dict(state["rl_detectors"])
        # the expert-feature collector follows this run's config, not the saved run's
        self.disabled = set(state["disabled"]) - {"expert-features"} | (self.disabled & {"expert-features"})
        prev = state.get("prev_load")
        self._prev_load = None if prev is None else torch.tensor(prev, device=self.device)

    def _write_expert_features(self) -> None:
        """Reduce the collected expert features and write them (collectives on every rank, once)."""
        features = self.expert_features
        if features is None or features.written or not features.steps or "expert-features" in self.disabled:
            return  # the same decision on every rank: steps and the disabled set are agreed
        self._agree(None)
        if "expert-features" in self.disabled:
            return
        features.written = True
        reduced = features.reduce(lambda: self._fail("expert-features"))
        self._agree(None)
        if "expert-features" in self.disabled or not self.is_logging_rank:
            return
        try:
            self._emit(features.write(self.config.output_dir, reduced))
        except Exception:
            self._fail("expert-features")
            self._report()

    def close(self) -> None:
        """Write expert features collected in a window that training cut short; close the sinks, drop snapshots."""
        if self.expert_features is not None and not self.expert_features.written:
            try:
                self._write_expert_features()
            except Exception:
                self._fail("expert-features")
                self._report()
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        self.snapshots.clear()

