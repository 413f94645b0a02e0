"""Fault injectors that act inside megatron-core (deterministic; each starts at optimizer step `start`).

- `lr-spike`: OptimizerParamScheduler.get_lr × x for the steps >= start.
- `router-bf16`: TopKRouter.gating's logits rounded through bf16 (instead of the fp32 router).
- `grad-overflow`: after Megatron's finalize_model_grads, the first gradient element of the first
  parameter whose name contains `param` becomes inf/nan at step `start` (once).
The step count comes from the optimizer-step counter of the patched get_megatron_optimizer.
"""
from __future__ import annotations

import functools

import torch

from mindspeed_proxy.patches.registry import Patch, register
from mindspeed_proxy.patches.runtime import RUNTIME

FEATURE = "fault-injection"


def _fault(name: str):
    return next((f for f in RUNTIME.faults if f.name == name), None)


def _upcoming_step() -> int:
    return (RUNTIME.iteration or 0) + 1


def get_lr_wrapper(original):
    """Multiply the scheduled learning rate by x from step `start` (lr-spike)."""

    @functools.wraps(original)
    def get_lr(self, param_group):
        lr = original(self, param_group)
        fault = _fault("lr-spike")
        return lr * fault["x"] if fault is not None and fault.active(_upcoming_step()) else lr

    return get_lr


def gating_wrapper(original):
    """Round the router logits through bf16 from step `start` (router-bf16)."""

    @functools.wraps(original)
    def gating(self, input):
        logits = original(self, input)
        fault = _fault("router-bf16")
        if fault is not None and fault.active(_upcoming_step()):
            return logits.to(torch.bfloat16).to(logits.dtype)
        return logits

    return gating


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


def register_all() -> None:
    """Add this feature's rows to the registry table."""
    rows = [
        ("megatron.core.optimizer_param_scheduler:OptimizerParamScheduler.get_lr", get_lr_wrapper, False),
        ("megatron.core.transformer.moe.router:TopKRouter.gating", gating_wrapper, False),
        ("megatron.core.distributed.finalize_model_grads:finalize_model_grads", finalize_model_grads_wrapper, False),
        ("megatron.core.distributed:finalize_model_grads", finalize_model_grads_wrapper, True),
        ("megatron.training.training:finalize_model_grads", finalize_model_grads_wrapper, True),
    ]
    for target, build, optional in rows:
        register(Patch(target, build, FEATURE, optional=optional,
                       description=(build.__doc__ or "").strip().splitlines()[0]))
