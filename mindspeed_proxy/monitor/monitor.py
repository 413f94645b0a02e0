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
from mindspeed_proxy.monitor.config import MonitorConfig
from mindspeed_proxy.monitor.detectors import GAP_CAUSES, ROUTING_MISMATCH, Alert, DetectorBank
from mindspeed_proxy.monitor.expert_features import ExpertFeatureCollector
from mindspeed_proxy.monitor.outputs import RunOutputs
from mindspeed_proxy.monitor.router import RouterStats, router_weight_stats, winner_persistence
from mindspeed_proxy.monitor.sinks import scalar_tags
from mindspeed_proxy.monitor.spectral_family import SpectralFamilies
from mindspeed_proxy.monitor.targets import collect
from mindspeed_proxy.monitor.threads import single_threaded

logger = logging.getLogger(__name__)

STATISTICS = ("router", "attention-spectral", "update-spectral", "expert-features")
ROUTER_WEIGHT_KEYS = ("similarity", "conditioning_ratio", "row_norm_mean", "row_norm_max")
NONFINITE_HINT = ("the first module whose output was non-finite (record `module`), else the first non-finite "
                  "gradient in backward order (`parameters`): check its inputs' scale, the precision it runs in, "
                  "the loss scale and gradient clipping")
ROUTER_SUMMARY_KEYS = ("entropy", "normalized_entropy", "load_entropy", "normalized_load_entropy",
                       "max_over_mean", "dead_experts", "overload", "margin")


def _model_config(chunk):
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk.config


class MechanismMonitor(RunOutputs, SpectralFamilies):
    """The mechanism monitor of one training job (construct on every rank, same config everywhere)."""

    # the step a resume loaded, when it fell inside a router window (that window's token sums are not saved); a class
    # default, so that hosts building their own state (hosts/hf_monitor.py) start with full windows too
    _router_window_from: Optional[int] = None

    def __init__(self, config, model, optimizer=None, process_groups: Optional[R.MonitorGroups] = None,
                 tensorboard_writer=None, wandb_writer=None, iteration: int = 0, resume: bool = False,
                 tensorboard_dir: Optional[str] = None):
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
        banks = cfg.detector_banks()
        self.spectral_detectors: DetectorBank = banks["attention-spectral"]
        self.router_detectors: DetectorBank = banks["router"]
        self.rl_detectors: DetectorBank = banks["rl"]
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
        self.alerts: list = []
        self.provenance_hook_calls = 0  # forward-hook calls of the last non-finite re-run (0: none ran)
        self.gap_cause: Optional[str] = None  # dominant term of the last gap decomposition fed to the rl family
        self.last: dict[str, dict] = {}
        self._open_run(tensorboard_writer, wandb_writer, resume, tensorboard_dir, {
            "type": "config", "config": cfg.to_dict(), "slots": t.slots, "iteration": iteration,
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
            with single_threaded(blas=False):  # torch only: small reductions, one thread
                self.router_stats.update(layer_number - 1, logits.detach(),
                                         None if topk_indices is None else topk_indices.detach())
        except Exception:
            self._fail("router")

    def after_optimizer_step(self, iteration: int) -> None:
        """Run what is due after a successful optimizer step `iteration` (1-based, Megatron's count)."""
        self.last_step = iteration
        try:
            self._settle(None, None, strict=False)  # no load came although one was expected: too late to refuse
            if not self._any_due(iteration):  # most steps: skip even the thread-limit switch (~0.1 ms)
                return
            with single_threaded():  # small calls at the trainer's thread count got slower (threads.py)
                self._after_step(iteration)
        except Exception:  # last resort: a collective failed; stop everything rather than training
            self._fail("monitor")
            self.disabled.update(STATISTICS)
            self._report()

    def _any_due(self, iteration: int) -> bool:
        cfg = self.config
        return ("router" not in self.disabled and iteration % cfg.router_interval == 0) or cfg.sample_step(iteration) \
            or cfg.snapshot_step(iteration) or (cfg.expert_features_step(iteration) and self.wants_moe_input)

    def _after_step(self, iteration: int) -> None:
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
        since, self._router_window_from = self._router_window_from, None
        window_steps = iteration - since if since is not None and 0 < iteration - since < self.config.router_interval \
            else None
        weights = torch.zeros(t.num_layers, len(ROUTER_WEIGHT_KEYS) + 1, device=self.device)
        owner = g.tp_rank == 0 and g.dp_rank == 0 and g.cp_rank == 0
        try:
            if owner:
                for layer, router in t.routers.items():
                    ws = router_weight_stats(router.weight.detach())
                    weights[layer, :-1] = torch.stack([ws[k] for k in ROUTER_WEIGHT_KEYS]).float()
                    weights[layer, -1] = 1.0
            stats.flush()  # the held router calls: a failure here is the family's, before the collective
        except Exception:
            self._fail("router")
            stats.reset()
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
            self._publish("router", iteration, records, per_layer, self.router_detectors, window_steps=window_steps)
        except Exception:
            self._fail("router")
        stats.reset()

    # ---------------------------------------------------------------- rl family
    def on_rl_step(self, iteration: int, per_layer: dict) -> None:
        """Detect on one RL step's metrics ({metric: {layer or None: value}}, already equal on every rank).

        Called by the RL loop after its own reductions, so it runs no collective; an exception
        disables the rl family on this rank (every rank sees the same values and fails alike). With the gap
        decomposition's shares (`gap_<term>_share`), mismatch alerts name its dominant term as the cause."""
        if "rl" in self.disabled or "rl" not in self.config.families:
            return
        try:
            shares = {t: per_layer[f"gap_{t}_share"][None] for t in GAP_CAUSES if f"gap_{t}_share" in per_layer}
            if len(shares) == len(GAP_CAUSES) and sum(shares.values()) > 0:
                self.gap_cause = max(shares, key=shares.get)
            records = {}
            for metric, layers in per_layer.items():
                for layer, value in layers.items():
                    records.setdefault("all" if layer is None else layer, {})[metric] = value
            self._publish("rl", iteration, records, per_layer, self.rl_detectors, relabel=self._gap_label)
        except Exception:
            self._fail("rl")
            self.disabled.add("rl")
            self._report()

    # ---------------------------------------------------------------- non-finite provenance
    def on_nonfinite(self, iteration: int, model_chunks, rerun) -> Optional[dict]:
        """At a step every rank agreed is non-finite: name its origin (provenance.locate: collectives on every
        rank), write one `non-finite` record and one alert; returns the record (None if locating failed)."""
        from mindspeed_proxy.monitor import provenance

        try:
            record, self.provenance_hook_calls = provenance.locate(model_chunks, rerun, iteration)
        except Exception:
            self._fail("monitor")
            self._report()
            return None
        text = provenance.alert_text(record)
        alert = Alert(step=iteration, family="non-finite", metric="origin", layer=None, head_or_expert=None,
                      value=float("nan"), baseline=None, z=None, kind="non-finite", mechanism=text,
                      mitigation=NONFINITE_HINT)
        self.alerts.append(alert)
        self._emit(record)
        self._emit({"type": "alert", **alert.to_dict()})
        if self.is_logging_rank:
            logger.warning("mechanism monitor: step %d: %s", iteration, text)
        return record

    # ---------------------------------------------------------------- detection and sinks
    def _gap_label(self, alert):
        if self.gap_cause is not None and (alert.mechanism == ROUTING_MISMATCH[0] or alert.metric == "gap_abs_mean"):
            alert.mechanism, alert.mitigation = GAP_CAUSES[self.gap_cause]
        return alert

    def _publish(self, family, iteration, records, per_layer, bank: DetectorBank, relabel=None,
                 window_steps: Optional[int] = None) -> None:
        """Record a sample and test it; a sample over a window a resume cut short (`window_steps`) is not tested."""
        name = self.targets.label  # MTP rows published as `mtp.N`
        records = {name(layer): r for layer, r in records.items()}
        per_layer = {m: {name(layer): v for layer, v in layers.items()} for m, layers in per_layer.items()}
        self.last[family] = {"step": iteration, "layers": records}
        series = self.config.detection_series(family, per_layer)
        tested = iteration >= self.config.detect_start and window_steps is None
        alerts = bank.update_many(iteration, series) if tested else []
        alerts = [relabel(a) for a in alerts] if relabel is not None else alerts
        self.alerts.extend(alerts)
        sample = {"type": "sample", "family": family, "step": iteration, "layers": records}
        self._emit(sample if window_steps is None else {**sample, "window_steps": window_steps})
        for alert in alerts:
            self._emit({"type": "alert", **alert.to_dict()})
        tags = scalar_tags(family, per_layer)
        for sink in self.sinks:
            sink.scalars(iteration, tags)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Detector state, disabled statistics, the last router load, the run id and last step (no snapshots)."""
        return {"version": 1, "run_id": self.run_log.run_id, "step": self.last_step,
                "spectral_detectors": self.spectral_detectors.state_dict(),
                "router_detectors": self.router_detectors.state_dict(),
                "rl_detectors": self.rl_detectors.state_dict(), "disabled": sorted(self.disabled),
                "prev_load": None if self._prev_load is None else self._prev_load.tolist()}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output (the next ΔW sample waits for a fresh snapshot); the run continues the
        saved run (RunFolderError when the output folder holds another)."""
        self._settle(state.get("run_id"), state.get("step"))
        if isinstance(state.get("step"), int):
            self.last_step = state["step"]
            self._router_window_from = state["step"] if state["step"] % self.config.router_interval else None
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
            # keyed as the converter's FILE inputs name layers: the global decoder layer, or mtp.N
            self._emit(features.write(self.config.output_dir,
                                      {self.targets.label(layer): v for layer, v in reduced.items()}))
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
        self._settle(None, None, strict=False)
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        self.snapshots.clear()

