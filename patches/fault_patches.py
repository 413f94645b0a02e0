"""Fault injectors that act inside megatron-core (deterministic; each starts at optimizer step `start`).

- `lr-spike`: OptimizerParamScheduler.get_lr × x for the steps >= start.
- `router-bf16`: TopKRouter.gating's logits rounded through bf16 (instead of the fp32 router).
- `rollout-router-noise` (RL): TopKRouter.gating's logits + N(0, std²) in rollout passes only, so near-tie
  routes flip between the sampler and the trainer (RUNTIME.phase says which pass runs).
- `small-gbs`: megatron's micro-batch calculator reports global batch `gbs` (fewer micro-batches per
  DP rank) for the steps >= start; Megatron-LM's loop and our trainer size each step by it.
- `grad-overflow`: after Megatron's finalize_model_grads, the first gradient element of the first
  parameter whose name contains `param` becomes inf/nan at step `start` (once).
- `nan-activation`: a forward hook on the module named `module` (as in a checkpoint, e.g.
  decoder.layers.1.self_attention) makes the first element of its output NaN/inf in the training forwards
  (and their non-finite re-run) of step `start` (once), on rank `rank` (-1: every rank); the hook is
  registered on the model chunks the patched get_megatron_optimizer receives.
- `lowp-attention`: megatron-core's DotProductAttention computes through the tiled FlashAttention-2
  emulator of mindspeed_proxy.faults.lowp_attention (low-precision P̄ / P̄V rounding) for the steps
  >= start; installed only when this fault is requested. Causal or maskless attention without
  attention bias or packed sequences; the emulation has no attention dropout.
The step count comes from the optimizer-step counter of the patched get_megatron_optimizer.
"""
from __future__ import annotations

import functools

import torch

from mindspeed_proxy.patches.registry import Patch, register, register_wrappers
from mindspeed_proxy.patches.runtime import RUNTIME

FEATURE = "fault-injection"
LOWP_FEATURE = "fault-lowp-attention"


def _fault(name: str):
    return next((f for f in RUNTIME.faults if f.name == name), None)


def _upcoming_step() -> int:
    return RUNTIME.current_step()


def get_lr_wrapper(original):
    """Multiply the scheduled learning rate by x from step `start` (lr-spike)."""

    @functools.wraps(original)
    def get_lr(self, param_group):
        lr = original(self, param_group)
        fault = _fault("lr-spike")
        return lr * fault["x"] if fault is not None and fault.active(_upcoming_step()) else lr

    return get_lr


def gating_wrapper(original):
    """Round the router logits through bf16 (router-bf16); add noise in rollout passes (rollout-router-noise)."""

    @functools.wraps(original)
    def gating(self, input):
        logits = original(self, input)
        fault = _fault("router-bf16")
        if fault is not None and fault.active(_upcoming_step()):
            logits = logits.to(torch.bfloat16).to(logits.dtype)
        noise = _fault("rollout-router-noise")
        if noise is not None and RUNTIME.phase == "rollout" and noise.active(_upcoming_step()):
            if getattr(self, "_rollout_noise_generator", None) is None:
                import torch.distributed as dist

                rank = dist.get_rank() if dist.is_initialized() else 0
                self._rollout_noise_generator = torch.Generator(device=logits.device).manual_seed(
                    noise["seed"] * 65537 + rank * 131 + self.layer_number)
            logits = logits + noise["std"] * torch.randn(logits.shape, generator=self._rollout_noise_generator,
                                                         device=logits.device, dtype=logits.dtype)
        return logits

    return gating


def _small_gbs():
    fault = _fault("small-gbs")
    return fault if fault is not None and fault.active(_upcoming_step()) else None


def get_num_microbatches_wrapper(original):
    """Fewer micro-batches per DP rank from step `start` (small-gbs)."""

    @functools.wraps(original)
    def get_num_microbatches():
        num = original()
        fault = _small_gbs()
        if fault is None:
            return num
        from megatron.core import num_microbatches_calculator as nmc

        per_microbatch = nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR.current_global_batch_size // num
        if fault["gbs"] % per_microbatch:
            raise ValueError(f"small-gbs: gbs={fault['gbs']} is not a multiple of micro-batch x data-parallel "
                             f"size = {per_microbatch}")
        return fault["gbs"] // per_microbatch

    return get_num_microbatches


def get_current_global_batch_size_wrapper(original):
    """The reduced global batch from step `start` (small-gbs)."""

    @functools.wraps(original)
    def get_current_global_batch_size():
        fault = _small_gbs()
        return original() if fault is None else fault["gbs"]

    return get_current_global_batch_size


def finalize_model_grads_wrapper(original):
    """Poison one gradient element at step `start` after gradient reduction (grad-overflow)."""

    @functools.wraps(original)
    def finalize_model_grads(model, *args, **kwargs):
        result = original(model, *args, **kwargs)
        fault = _fault("grad-overflow")
        if fault is not None and _upcoming_step() == fault["start"]:
            value = float(fault["value"])
            for chunk in model:
                for name, param in chunk.named_parameters():
                    grad = getattr(param, "main_grad", None)
                    grad = param.grad if grad is None else grad
                    if fault["param"] in name and grad is not None:
                        grad.view(-1)[0] = value
                        return result
        return result

    return finalize_model_grads


def _poison(output, value: float):
    """`output` (a tensor, or a tuple whose first item is one) with its first element set to `value`."""
    if isinstance(output, tuple):
        return (_poison(output[0], value),) + output[1:]
    poisoned = output.clone()
    poisoned.view(-1)[0] = value
    return poisoned


def attach_activation_faults(model_chunks) -> list:
    """Register the nan-activation hooks on the named modules of `model_chunks`; return the handles.

    Raises ValueError naming the module when no chunk of this rank has it (pipeline parallel: a module on
    another stage is found there)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    handles = []
    for fault in (f for f in RUNTIME.faults if f.name == "nan-activation"):
        rank = dist.get_rank() if dist.is_initialized() else 0
        value = float(fault["value"])

        def hook(module, inputs, output, fault=fault, value=value):
            if RUNTIME.phase in ("train", "rerun") and _upcoming_step() == fault["start"]:
                return _poison(output, value)
            return None

        modules = [dict(chunk.named_modules()).get(fault["module"]) for chunk in unwrap_model(list(model_chunks))]
        modules = [m for m in modules if m is not None]
        if not modules and ps.get_pipeline_model_parallel_world_size() == 1:
            raise ValueError(f"--inject-fault nan-activation: the model has no module {fault['module']!r} "
                             "(names as in a checkpoint, e.g. decoder.layers.0.self_attention)")
        if fault["rank"] in (-1, rank):
            handles += [m.register_forward_hook(hook) for m in modules]
    return handles


def core_attention_forward_wrapper(original):
    """Route DotProductAttention through the low-precision FA2 emulator from step `start` (lowp-attention)."""

    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        fault = _fault("lowp-attention")
        args = (query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if fault is None or not fault.active(_upcoming_step()) or attention_bias is not None \
                or packed_seq_params is not None:
            return original(self, *args)
        from megatron.core.transformer.enums import AttnMaskType

        from mindspeed_proxy.faults.lowp_attention import lowp_attention

        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        if not causal and attention_mask is not None:
            return original(self, *args)  # padding masks are not emulated
        if self.training and self.config.attention_dropout > 0:
            raise ValueError("lowp-attention emulates attention without dropout; set attention_dropout=0")
        if getattr(self, "_lowp_generator", None) is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else 0
            self._lowp_generator = torch.Generator(device=query.device).manual_seed(fault["seed"] * 65537 + rank)
        bits = fault["bits"] or fault["format"]
        out = lowp_attention(query, key, value, causal=causal, scale=self.softmax_scale, block_q=fault["block"],
                             block_k=fault["block"], mantissa_bits=bits, rounding=fault["rounding"],
                             round_targets=tuple(fault["targets"].split("+")), generator=self._lowp_generator)
        return out

    return forward


def register_all() -> None:
    """Add this feature's rows to the registry table."""
    rows = [
        ("megatron.core.optimizer_param_scheduler:OptimizerParamScheduler.get_lr", get_lr_wrapper, False),
        ("megatron.core.transformer.moe.router:TopKRouter.gating", gating_wrapper, False),
        ("megatron.core.distributed.finalize_model_grads:finalize_model_grads", finalize_model_grads_wrapper, False),
        ("megatron.core.distributed:finalize_model_grads", finalize_model_grads_wrapper, True),
        ("megatron.training.training:finalize_model_grads", finalize_model_grads_wrapper, True),
        ("megatron.core.num_microbatches_calculator:get_num_microbatches", get_num_microbatches_wrapper, False),
        ("megatron.core.num_microbatches_calculator:get_current_global_batch_size",
         get_current_global_batch_size_wrapper, False),
        ("megatron.training.training:get_num_microbatches", get_num_microbatches_wrapper, True),
        ("megatron.training.training:get_current_global_batch_size", get_current_global_batch_size_wrapper, True),
    ]
    register_wrappers(rows, FEATURE)
    register(Patch("megatron.core.transformer.dot_product_attention:DotProductAttention.forward",
                   core_attention_forward_wrapper, LOWP_FEATURE,
                   description=core_attention_forward_wrapper.__doc__.strip().splitlines()[0]))
