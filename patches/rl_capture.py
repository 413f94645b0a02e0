"""What the rl rows (patches/rl_rows.py) saw during one of Megatron-LM's RL updates, and the step they feed.

One `Capture` per process. A rollout collection (`megatron_rl_inference_mode`) starts a fresh `RolloutRouting`
that the router tap fills from the dynamic engine's flattened tokens (its context maps each token to its
request and position). `prepare_data_for_update` then opens an update: the table is merged over all ranks;
the first logprob pass inside it (pi_old) records the training-side experts, the rows and the entropy of the
full next-token distribution; `align_unpacked_inference_logprobs` hands over the inference logprobs aligned to
pi_old and the generation mask. When the update returns, `finish()` feeds `RolloutObserver` (rl/observe.py)
at train_rl.py's iteration. With R3 every logprob pass of the update and every training pass replays the
rollout's experts from the same table (rl/rollout_routing.py).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from mindspeed_proxy.patches.runtime import RUNTIME
from mindspeed_proxy.rl.rollout_routing import RolloutRouting, TrainRouting, engine_to_router_order, forward_fill
from mindspeed_proxy.rl.rollout_routing import topk_of

logger = logging.getLogger("mindspeed_proxy")


class Capture:
    """The state between the rows of one process (see the module docstring)."""

    def __init__(self):
        self.rollout = RolloutRouting()
        self.context = None  # the dynamic engine's context of the step in flight
        self.context_layers: set = set()  # MoE layers that recorded it (a second pass is a dummy forward)
        self.table: Optional[RolloutRouting] = None  # the merged rollout table of the open update
        self.in_update = False
        self.passes = 0
        self.old_pass = False
        self.train_routing = TrainRouting()
        self.rows: list = []
        self.entropy: list = []
        self.aligned = None
        self.observer = None
        self.last_record: Optional[dict] = None  # the step record of the last update (RolloutObserver's)
        self.num_experts: Optional[int] = None
        self.top_k: Optional[int] = None
        self.warned: set = set()
        self.failed = False
        self.r3_unreplayed_passes = 0  # forwards under R3 with a row no rollout starts: routed without replay
        self.duplicates: Optional[float] = None  # share of the update's samples repeating one of their group

    def active(self) -> bool:
        """Whether anything wants the capture: the monitor or R3."""
        return not self.failed and (RUNTIME.monitor is not None or RUNTIME.routing_replay == "r3")

    def warn(self, key: str, message: str) -> None:
        """Log `message` once per process."""
        if key not in self.warned:
            self.warned.add(key)
            logger.warning("mindspeed-proxy: %s", message)

    # ------------------------------------------------------------ router tap
    def on_routing(self, router, probs: torch.Tensor, routing_map: torch.Tensor) -> None:
        """The experts one TopKRouter chose: recorded for the rollout table or for the pi_old pass."""
        if not self.active():
            return
        try:
            self.num_experts, self.top_k = router.config.num_moe_experts, router.topk
            if RUNTIME.phase == "rollout":
                self._record_rollout(router.layer_number, probs, routing_map)
            elif self.old_pass:
                self.train_routing.add(router.layer_number, topk_of(routing_map, router.topk))
        except Exception as exc:  # the monitor never breaks training
            self.failed = True
            self.warn("tap", f"rl rows disabled: routing capture failed ({type(exc).__name__}: {exc})")

    def _record_rollout(self, layer: int, probs: torch.Tensor, routing_map: torch.Tensor) -> None:
        ctx = self.context
        if ctx is None or layer in self.context_layers:  # an EP dummy forward asks the context nothing
            return
        self.context_layers.add(layer)
        active = int(ctx.active_token_count)
        if routing_map.shape[0] != int(ctx.padded_active_token_count):
            self.warn("rollout-shape", "rollout experts not recorded: the router saw a shard of the engine's "
                                       "tokens (sequence parallel); the rl family compares no routing")
            return
        if active == 0:
            return
        slots = ctx.token_to_request_idx[:active].long()
        rank = dist.get_rank() if dist.is_initialized() else 0
        experts = topk_of(routing_map[:active], self.top_k)
        weights = probs[:active].gather(1, experts.to(probs.device)) if RUNTIME.rl_gap_interval else None
        self.rollout.record(layer, ctx.request_ids[slots].cpu(), ctx.token_to_pos_ids[:active].cpu(),
                            ctx.token_to_input_ids[:active].cpu(), experts, rank, probs=weights)

    # ------------------------------------------------------------ the update
    def begin_update(self, sequence_packing: bool) -> None:
        """An update starts (every rank): merge the rollout tables over all ranks."""
        self.in_update, self.passes, self.aligned = True, 0, None
        self.rows, self.entropy, self.train_routing = [], [], TrainRouting()
        self.table = None if sequence_packing else self.rollout.gather()

    def on_rollouts(self, rollouts) -> None:
        """The update's grouped rollouts (every rank has all of them): the share of repeated samples per group."""
        from mindspeed_proxy.rl.stats import duplicate_share

        try:
            groups = [[repr(getattr(r, "trajectory", r)) for r in group] for group in rollouts or []]
            self.duplicates = duplicate_share(groups)
        except Exception:  # a rollout layout we do not read: no share
            self.duplicates = None
        world = dist.get_world_size() if dist.is_initialized() else 1
        if self.duplicates and world > 1:
            self.warn("duplicates", f"rl family: {self.duplicates:.0%} of this update's samples repeat another sample "
                                    "of their group (logged as duplicate_share). On several data-parallel engines that "
                                    "sample with one seed (Megatron-LM before core_v0.19: inference_sampling_seed = "
                                    "--seed on every rank) each rank draws the same tokens for the same prompt; a "
                                    "low-entropy policy repeats itself too (logged once)")

    def replay_indices(self, tokens: torch.Tensor) -> Optional[torch.Tensor]:
        """[L, S·B, k] rollout experts for a forward over `tokens` [B, S] under R3, else None."""
        if RUNTIME.routing_replay != "r3" or self.table is None or not self.table.layers:
            return None
        experts, recorded = self.table.lookup(tokens.cpu(), top_k=self.top_k)
        unmatched = int((~recorded.any(dim=1)).sum())
        if unmatched:  # never a crash: this pass routes as it would without R3, and says so
            self.r3_unreplayed_passes += 1
            self.warn("r3-unmatched", f"R3: {unmatched} of {tokens.shape[0]} training rows match no rollout the "
                                      "engine ran (their tokens start no recorded request); that pass routes without "
                                      "replay (counted in r3_unreplayed_passes; logged once)")
            return None
        return engine_to_router_order(forward_fill(experts, recorded)).to(tokens.device)

    def on_old_entropy(self, logits: torch.Tensor) -> None:
        """Entropy of the full next-token distribution at each position of the pi_old pass (float32)."""
        logp = torch.log_softmax(logits.detach().float(), dim=-1)
        self.entropy.append(-(logp.exp() * logp).sum(dim=-1).cpu())

    def on_aligned(self, inference_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                   generation_masks: torch.Tensor) -> None:
        """Megatron-LM's aligned inference logprobs [B, S-1], pi_old [B, S-1] and the mask it compares them on."""
        width = old_logprobs.shape[1]
        mask = generation_masks[:, 1:width + 1].bool()
        if mask.shape[1] < width:
            mask = torch.nn.functional.pad(mask, (0, width - mask.shape[1]), value=False)
        self.aligned = (inference_logprobs.detach().cpu(), old_logprobs.detach().cpu(), mask.cpu())

    def finish(self, group, model=None, micro_batch: Optional[int] = None) -> Optional[dict]:
        """The update returned (every rank of `group`, the data-parallel group): feed the rl family (with the
        gap decomposition on `model` when --mechanism-monitor-rl-gap-interval says so)."""
        self.in_update, self.old_pass = False, False
        if RUNTIME.monitor is None:
            return None
        if self.aligned is None:
            self.warn("aligned", "rl family: no aligned inference logprobs in this update (sequence packing is "
                                 "not read by the rl rows); no rl sample")
            return None
        rollout_lp, old_lp, mask = self.aligned
        entropy = torch.cat(self.entropy) if self.entropy else None
        train_idx, layers = self.train_routing.take()
        rows = torch.cat(self.rows) if self.rows else None
        routed = positions = probs = None
        if train_idx is not None and self.table is not None and rows is not None and rows.shape[0] == mask.shape[0]:
            gap = RUNTIME.rl_gap_interval and RUNTIME.current_step() % RUNTIME.rl_gap_interval == 0
            found = self.table.lookup(rows, layers, top_k=train_idx.shape[-1], with_probs=bool(gap))
            routed, positions = found[0], found[1]
            if gap and model is not None and bool(positions.any(dim=1).all()):
                probs = forward_fill(found[2], positions)
        device = _device(model) if model is not None else torch.device("cpu")  # the group's backend reduces there
        usable = torch.tensor([float(entropy is not None and entropy.shape == mask.shape),
                               float(routed is not None), float(probs is not None)], dtype=torch.float64,
                              device=device)
        if dist.is_initialized():  # every rank of the group reduces tensors of the same layout
            dist.all_reduce(usable, op=dist.ReduceOp.MIN, group=group)
        if usable[1] < 1:
            self.warn("routing", "rl family: rollout vs training experts not compared in this update (no rollout "
                                 "table, or sequence-parallel shards)")
        from mindspeed_proxy.rl.observe import RolloutObserver

        if self.observer is None or self.observer.monitor is not RUNTIME.monitor:
            self.observer = RolloutObserver(RUNTIME.monitor, group, num_experts=self.num_experts,
                                            gap_interval=max(RUNTIME.rl_gap_interval, 1),
                                            gap_samples=RUNTIME.rl_gap_samples)
        with_routing, with_gap = usable[1] >= 1, usable[2] >= 1
        if with_routing:  # the gap's passes replay the rollout's experts at every position (filled where not run)
            routed = forward_fill(routed, positions)
        on = lambda t: None if t is None else t.to(device)  # noqa: E731
        gap = dict(model=model, input_ids=on(rows), routed_probs=on(probs), micro_batch=micro_batch,
                   replays_rollout_experts=RUNTIME.routing_replay == "r3") if with_gap else {}
        self.last_record = self.observer.observe(
            RUNTIME.current_step(), on(rollout_lp), on(old_lp), on(mask), on(routed) if with_routing else None,
            train_routed_experts=on(train_idx) if with_routing else None,
            entropy=on(entropy) if usable[0] >= 1 else None,
            routed_positions=on(positions) if with_routing else None, duplicate_share=self.duplicates, **gap)
        return self.last_record


def _device(model) -> torch.device:
    return next(model.parameters()).device


CAPTURE = Capture()
