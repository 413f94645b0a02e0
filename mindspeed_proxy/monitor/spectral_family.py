"""The monitor's spectral families: weight snapshots, ΔW spectra (update-spectral) and QK-increment spectra
(attention-spectral, MHA/GQA and MLA), each computed inside a guard, shared over ranks with fixed-shape
collectives outside the guards, and published per layer. A mixin of MechanismMonitor (its state and sinks)."""
from __future__ import annotations

from typing import Optional

import torch

from mindspeed_proxy.monitor import reductions as R
from mindspeed_proxy.monitor.config import STAT_NAMES
from mindspeed_proxy.monitor.mla_layout import (
    TP_GATHERED,
    attention_terms,
    mla_increment_rank_tol,
    mla_increment_singular_values,
    mla_layout_of,
    mla_qk_blocks,
    mla_read,
    sharded_rows,
)
from mindspeed_proxy.monitor.qk_layout import group_shared_keys, layernorm_scale, layout_of, qk_blocks
from mindspeed_proxy.monitor.spectral_routes import gram_rank_tol, lowrank_rank_tol, qk_spectra_rank_tol
from mindspeed_proxy.monitor.spectral import (
    qk_increment_spectra,
    singular_values_from_gram,
    spectral_stats,
    update_gram,
)
from mindspeed_proxy.monitor.threads import single_threaded

NSTAT = len(STAT_NAMES)


def stats_vector(sigma: torch.Tensor, matrix_dim: int, rank_tol: Optional[float] = None) -> torch.Tensor:
    """The STAT_NAMES statistics of singular values `sigma` ([..., n]) as a float32 vector.

    `rank_tol`: the noise floor of the route that produced `sigma` (`spectral_routes`); None for an SVD's.
    """
    stats = spectral_stats(sigma, matrix_dim=matrix_dim, rank_tol=rank_tol)
    return torch.stack([stats[name] for name in STAT_NAMES], dim=-1).float()


def update_stats(gram: torch.Tensor) -> torch.Tensor:
    """The STAT_NAMES vector of a ΔW from its (summed) n×n Gram: σ = √eig, floored at √(n·eps)·σ_max.

    The floor is the Gram's own size n, not the length d of its dot products (ΔW's other side): the null-space σ of
    a float32 ΔW come out near √eps·σ_max whatever d ((3.2-4.6)e-4·σ_max for d = 16384-262144 at n = 64, below
    √(64·eps) = 2.8e-3), while the worst-case √(d·eps) would drop real σ below 0.18·σ_max at d = 262144
    (tests/monitor/test_spectral.py)."""
    sigma, n = singular_values_from_gram(gram), gram.shape[-1]
    return stats_vector(sigma, n, gram_rank_tol(n, n, sigma.dtype))


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return [t for item in items for t in _tensors(item)]


class SpectralFamilies:
    """The spectral half of MechanismMonitor: snapshots W_{t-δ}, and at sampled steps the spectra of ΔW and
    of the QK increment terms (uses the monitor's targets, groups, config, guards and _publish)."""

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
        """Bytes this rank holds between samples: the fp32 weight snapshots and the cached QK Gram blocks."""
        held = {id(t): t for t in _tensors([self.snapshots, self._qk_grams, self._qk_pending])}  # the two Gram
        return sum(t.numel() * t.element_size() for t in held.values())  # caches may be one dict after a sample

    @single_threaded()  # the families' small calls on one thread (nested in after_optimizer_step's block)
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
        self._share_and_publish(iteration, update_table, attn_table, lambda flat: R.share_model_table(flat, g))

    def _share_and_publish(self, iteration: int, update_table, attn_table, share) -> None:
        """Both tables through one in-place collective `share(flat)`, failures agreed, then published."""
        flat = torch.cat([update_table.view(-1), attn_table.view(-1)])
        share(flat)
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
                table[w.layer, w.slot, :NSTAT] = update_stats(gram)
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
                    tol = qk_spectra_rank_tol(*blocks[0].shape[-2:], sigma.dtype, term, weight.shape[-1])
                    table[a.layer, heads, ti, :NSTAT] = stats_vector(sigma, weight.shape[-1], tol)
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
                    col, d = pi * len(terms) + ti, self.model_config.hidden_size
                    tol = mla_increment_rank_tol(*parts[part], term=term, matrix_dim=d)
                    table[a.layer, heads, col, :NSTAT] = stats_vector(sigma, d, tol)
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
