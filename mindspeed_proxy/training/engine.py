"""A real megatron-core training step: DDP, get_megatron_optimizer, Megatron's scheduler and schedules.

Used by `examples/train_moe.py`, the tests and the demo. parallel_state must be initialised.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch

from mindspeed_proxy.tiny_moe import TinyMoEConfig, build_model, transformer_config


@dataclass
class TrainConfig:
    """Optimisation settings (Megatron-LM argument names)."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 0
    lr_decay_style: str = "cosine"
    lr_decay_iters: Optional[int] = None
    train_iters: int = 100
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    micro_batch_size: int = 2
    global_batch_size: int = 8
    use_distributed_optimizer: bool = False
    initial_loss_scale: float = 4096.0  # fp16 only (Megatron-LM's default 2^32 overflows for dozens of steps)
    seed: int = 1234


def data_parallel_size() -> int:
    """Data-parallel size of the dense part (world / (TP x PP x CP))."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size()


def split_microbatches(rows: int, micro_batch_size: int) -> int:
    """Micro-batches of `rows` rows of one data-parallel rank; raises unless `micro_batch_size` divides `rows`."""
    if rows < 1 or micro_batch_size < 1 or rows % micro_batch_size:
        raise ValueError(f"{rows} rows per data-parallel rank are not a multiple of --micro-batch-size "
                         f"{micro_batch_size}")
    return rows // micro_batch_size


def num_microbatches(cfg: TrainConfig) -> int:
    """Micro-batches per step on each DP rank; raises if the global batch does not split evenly."""
    dp = data_parallel_size()
    if cfg.global_batch_size % (cfg.micro_batch_size * dp):
        raise ValueError(
            f"--global-batch-size {cfg.global_batch_size} is not divisible by --micro-batch-size "
            f"{cfg.micro_batch_size} x data-parallel size {dp}"
        )
    return split_microbatches(cfg.global_batch_size // dp, cfg.micro_batch_size)


def microbatch_sample_ids(cfg: TrainConfig, iteration: int) -> list[list[int]]:
    """Global sample ids of each micro-batch of this DP rank at `iteration` (Megatron's sampler order).

    Step `iteration` reads the window [iteration·GBS, (iteration+1)·GBS) of the configured global
    batch; when megatron's micro-batch calculator reports a smaller current global batch (the
    small-gbs fault), the step takes the first samples of that window, so earlier steps are unchanged.
    """
    from megatron.core import parallel_state as ps

    dp, dp_rank = data_parallel_size(), ps.get_data_parallel_rank()
    start = iteration * cfg.global_batch_size
    mbs = cfg.micro_batch_size
    return [
        list(range(start + (m * dp + dp_rank) * mbs, start + (m * dp + dp_rank + 1) * mbs))
        for m in range(current_num_microbatches(cfg))
    ]


def current_num_microbatches(cfg: TrainConfig) -> int:
    """Micro-batches of this step, from megatron's calculator (initialised by Trainer)."""
    from megatron.core import num_microbatches_calculator as nmc

    return nmc.get_num_microbatches()


def init_microbatch_calculator(cfg: TrainConfig) -> None:
    """(Re)initialise megatron's global micro-batch calculator for `cfg` (as Megatron-LM does)."""
    import torch.distributed as dist
    from megatron.core import num_microbatches_calculator as nmc

    nmc.unset_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(dist.get_rank(), None, cfg.global_batch_size, cfg.micro_batch_size,
                                         data_parallel_size())


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    from megatron.core import parallel_state as ps

    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    reported = loss.detach().clone()
    torch.distributed.all_reduce(reported, group=ps.get_data_parallel_group())
    reported /= ps.get_data_parallel_world_size()
    return loss, {"lm loss": reported}


def forward_step(data_iterator, model):
    """Megatron forward-step function: model output and the masked-mean LM loss closure."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


class Trainer:
    """Model chunks wrapped in Megatron DDP, Megatron's optimizer and LR scheduler, one step at a time."""

    def __init__(self, model_cfg: TinyMoEConfig, train_cfg: TrainConfig,
                 init_fn: Optional[Callable[[torch.nn.Module], None]] = None):
        """Build model, DDP, optimizer and scheduler; `init_fn(model)` (default: `global_init` by the
        seed) sets the weights so that every parallel layout starts from the same model."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.model_cfg, self.cfg = model_cfg, train_cfg
        self.config = transformer_config(model_cfg)
        num_microbatches(train_cfg)  # refuses a global batch that does not split evenly
        init_microbatch_calculator(train_cfg)
        vpp = self.config.virtual_pipeline_model_parallel_size  # interleaved pipeline: one chunk per stage
        chunks = [build_model(model_cfg, self.config, vp_stage=v) for v in range(vpp)] if vpp else \
            [build_model(model_cfg, self.config)]
        if init_fn is None:  # Megatron's CPU init repeats the experts of each EP rank: draw per global name
            from mindspeed_proxy.layout_init import global_init

            init_fn = lambda m: global_init(m, seed=train_cfg.seed, std=model_cfg.init_method_std)  # noqa: E731
        for chunk in chunks:
            init_fn(chunk)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=train_cfg.use_distributed_optimizer,
            check_for_nan_in_grad=False,
        )
        self.model = [DistributedDataParallel(self.config, ddp_config, chunk, disable_bucketing=v > 0)
                      for v, chunk in enumerate(chunks)]
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=train_cfg.lr,
            min_lr=train_cfg.min_lr,
            weight_decay=train_cfg.weight_decay,
            adam_beta1=train_cfg.adam_beta1,
            adam_beta2=train_cfg.adam_beta2,
            adam_eps=train_cfg.adam_eps,
            clip_grad=train_cfg.clip_grad,
            bf16=model_cfg.bf16,
            fp16=model_cfg.fp16,
            initial_loss_scale=train_cfg.initial_loss_scale,
            params_dtype=self.config.params_dtype,
            use_distributed_optimizer=train_cfg.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_config, self.model)
        gbs = train_cfg.global_batch_size
        decay_iters = train_cfg.lr_decay_iters or train_cfg.train_iters
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if train_cfg.lr_warmup_iters else train_cfg.lr,
            max_lr=train_cfg.lr,
            min_lr=train_cfg.min_lr,
            lr_warmup_steps=train_cfg.lr_warmup_iters * gbs,
            lr_decay_steps=max(decay_iters, 1) * gbs,
            lr_decay_style=train_cfg.lr_decay_style,
            start_wd=train_cfg.weight_decay,
            end_wd=train_cfg.weight_decay,
            wd_incr_steps=max(train_cfg.train_iters, 1) * gbs,
            wd_incr_style="constant",
        )
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        no_sync = [chunk.no_sync for chunk in self.model]
        self.config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
        self.monitor = None  # a MechanismMonitor, told after every successful optimizer step

    def unwrapped(self) -> list[torch.nn.Module]:
        """The model chunks without DDP / Float16Module wrappers (what checkpoints hold)."""
        from megatron.core.utils import unwrap_model

        return unwrap_model(self.model)

    def train_step(self, microbatches: list[dict], iteration: Optional[int] = None,
                   forward_step_func: Callable = forward_step, loss_key: str = "lm loss") -> dict:
        """One optimizer step over this rank's micro-batches; returns loss, grad_norm, lr, skipped, reports.

        `iteration` is the 1-based number of this step (Megatron's counter after the step); the
        monitor, if any, is told after a successful step. `forward_step_func` is Megatron's
        forward-step function (default: the masked-mean LM loss); its loss closure reports `loss_key`,
        and `reports` holds every micro-batch's report on the last pipeline stage."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        monitor = self._provenance_monitor()
        start_rng = None
        if monitor is not None:  # the state a re-run of this step starts from (a non-finite step only)
            from mindspeed_proxy.monitor.provenance import rng_state

            start_rng = rng_state()
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step_func,
            data_iterator=[iter(microbatches) for _ in self.model] if len(self.model) > 1 else iter(microbatches),
            model=self.model,
            num_microbatches=len(microbatches),
            seq_length=self.model_cfg.seq_length,
            micro_batch_size=self.cfg.micro_batch_size,
            forward_only=False,
        )
        nonfinite = self._nonfinite(losses, loss_key)
        if nonfinite and monitor is not None:  # every rank: the flag is agreed over the world
            monitor.on_nonfinite(iteration if iteration is not None else _step_in_progress(), self.model,
                                 partial(self._rerun_forward, microbatches, forward_step_func, start_rng))
        if nonfinite:  # never applied: the weights, the optimizer state and the LR schedule stay as they were
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            ok, grad_norm = False, float("nan")
            count = getattr(self.optimizer, "count_skipped_step", None)  # the step counter of patched runs
            if count is not None:
                count()
        else:
            ok, grad_norm, _ = self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        if ok:
            self.scheduler.step(increment=self.cfg.global_batch_size)
            if self.monitor is not None and iteration is not None:
                self.monitor.after_optimizer_step(iteration)
        loss = torch.zeros(1, dtype=torch.float64)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            loss += sum(float(x[loss_key]) for x in losses) / max(len(losses), 1)
        torch.distributed.broadcast(loss, src=ps.get_pipeline_model_parallel_last_rank(),
                                    group=ps.get_pipeline_model_parallel_group())
        return {"loss": float(loss), "grad_norm": None if grad_norm is None else float(grad_norm),
                "lr": lr, "skipped": not ok, "nonfinite": nonfinite, "reports": losses}

    def _provenance_monitor(self):
        """The monitor told about non-finite steps: this trainer's, else the patched run's."""
        from mindspeed_proxy.patches.runtime import RUNTIME

        return self.monitor if self.monitor is not None else RUNTIME.monitor

    def _rerun_forward(self, microbatches: list[dict], forward_step_func: Callable, start_rng) -> None:
        """The step's forward again (Megatron's schedule, forward only, no grad) from the step's RNG state."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from mindspeed_proxy.monitor.provenance import rerun_context
        from mindspeed_proxy.patches.runtime import RUNTIME

        previous, RUNTIME.phase = RUNTIME.phase, "rerun"  # the router family does not count this forward
        try:
            with rerun_context(start_rng), torch.no_grad():
                get_forward_backward_func()(
                    forward_step_func=forward_step_func,
                    data_iterator=[iter(microbatches) for _ in self.model] if len(self.model) > 1
                    else iter(microbatches),
                    model=self.model, num_microbatches=len(microbatches), seq_length=self.model_cfg.seq_length,
                    micro_batch_size=self.cfg.micro_batch_size, forward_only=True)
        finally:
            RUNTIME.phase = previous

    def _nonfinite(self, reports: list, loss_key: str) -> bool:
        """True on every rank when any rank's loss or (without fp16 loss scaling) gradient is NaN or inf.

        Megatron-LM checks both by default (`--check-for-nan-in-loss-and-grad`). Under fp16 loss scaling an
        inf gradient is an overflow that the optimizer's grad scaler skips and answers by lowering the scale,
        so only the loss is checked there."""
        bad = any(not torch.isfinite(torch.as_tensor(r[loss_key])).all() for r in reports)
        if not self.model_cfg.fp16:
            for chunk in self.model:
                for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                    bad = bad or not bool(torch.isfinite(buffer.grad_data).all())
        flag = torch.tensor([float(bad)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())


def _step_in_progress() -> int:
    from mindspeed_proxy.patches.runtime import RUNTIME

    return RUNTIME.current_step()
