"""Non-finite provenance: where a step whose loss, gradient or grad norm is NaN/inf went non-finite first.

Runs only on such a step (every rank agrees on it first, so every rank joins the same collectives):
- the gradients are scanned, and the parameters holding a non-finite gradient are listed in backward
  order (the module used last in the forward first);
- the step's forward is re-run on the same micro-batches from the step's starting RNG state, with a
  forward hook on every module, installed for the re-run only; the first module, in forward order, whose
  output holds a NaN/inf is the origin;
- the ranks' findings are gathered; the origin is the earliest module over the ranks (lowest rank on a
  tie), else the first parameter in backward order, else the loss itself.

Megatron's RerunStateMachine (megatron/core/rerun_state_machine.py) re-runs a whole step to tell a
transient from a persistent fault; it does not locate one, needs CUDA (its RNG state and flag
all-reduces are on 'cuda') and a training loop built around `should_run_forward_backward`. This module
takes its recipe instead: the same step's data (the trainer keeps its micro-batches) and its saved RNG
state (torch, CUDA when present, the tensor-parallel tracker) restored for the re-run.
"""
from __future__ import annotations

import contextlib
import re
from functools import partial
from typing import Callable, Optional

import torch

_LOCAL_EXPERT = re.compile(r"^(.*)\.experts\.local_experts\.(\d+)(\..*)?$")
MAX_PARAMETERS = 16  # parameters named per rank in the record (the count covers them all)


def has_nonfinite(value) -> bool:
    """Whether any floating tensor in a (nested tuple / list / dict) module output holds NaN or inf."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and value.numel() > 0 and not bool(torch.isfinite(value).all())
    if isinstance(value, (tuple, list)):
        return any(has_nonfinite(v) for v in value)
    if isinstance(value, dict):
        return any(has_nonfinite(v) for v in value.values())
    return False


def named_modules(chunks) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module of the unwrapped model chunks, named as in a checkpoint
    ("decoder.layers.1.self_attention"; the chunk's root by its class; `chunk{i}.` with several chunks);
    experts carry their global index, so a name means the same module on every rank."""
    from megatron.core.utils import unwrap_model

    unwrapped = unwrap_model(list(chunks))
    out = []
    for i, chunk in enumerate(unwrapped):
        prefix = f"chunk{i}." if len(unwrapped) > 1 else ""
        modules = dict(chunk.named_modules())
        for name, module in modules.items():
            out.append((prefix + (_global_expert_name(name, modules) or type(chunk).__name__), module))
    return out


def _global_expert_name(name: str, modules: dict) -> str:
    """`name` with a local expert index (`experts.local_experts.i`) replaced by the MoE layer's global one."""
    match = _LOCAL_EXPERT.match(name)
    indices = getattr(modules.get(match.group(1)), "local_expert_indices", None) if match else None
    if not indices or int(match.group(2)) >= len(indices):
        return name
    return f"{match.group(1)}.experts.local_experts.{indices[int(match.group(2))]}{match.group(3) or ''}"


class ForwardTrace:
    """Forward hooks on every module while entered: the first module output holding NaN/inf, and when each
    module last ran (its position in the forward order)."""

    def __init__(self, modules: list[tuple[str, torch.nn.Module]]):
        self.modules = modules
        self.calls = 0
        self.first: Optional[tuple[int, str]] = None  # (position in forward order, module name)
        self.last_use: dict[str, int] = {}
        self._handles: list = []

    def _hook(self, name, module, inputs, output):
        try:
            self.calls += 1
            self.last_use[name] = self.calls
            if self.first is None and has_nonfinite(output):
                self.first = (self.calls, name)
        except Exception:  # an output we cannot read is not a finding; the forward goes on
            pass

    def __enter__(self):
        self._handles = [module.register_forward_hook(partial(self._hook, name)) for name, module in self.modules]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []


def nonfinite_gradients(modules) -> list[tuple[str, int, str]]:
    """(module name, module index, parameter name) of every parameter whose gradient (main_grad under
    Megatron DDP) holds NaN or inf."""
    found = []
    for index, (module_name, module) in enumerate(modules):
        for name, param in module.named_parameters(recurse=False):
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None and not bool(torch.isfinite(grad).all()):
                found.append((module_name, index, f"{module_name}.{name}"))
    return found


def backward_order(found, last_use: dict[str, int]) -> list[tuple[str, int, int]]:
    """(parameter name, sort key...) of `nonfinite_gradients` in backward order: those of the module that
    ran last in the forward first; parameters of modules the forward did not reach last."""
    keyed = [(name, -last_use.get(module, 0), -index) for module, index, name in found]
    return sorted(keyed, key=lambda k: k[1:])


def rng_state() -> dict:
    """The RNG state a re-run of the step starts from: torch, CUDA when present, and the tensor-parallel
    tracker (dropout, router jitter). Python's and NumPy's generators feed data pipelines, which the
    re-run does not repeat (it replays the step's micro-batches), so they are left out."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": None,
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    try:
        state["tracker"] = dict(get_cuda_rng_tracker().get_states())
    except Exception:  # no tracker initialised (a model built outside Megatron's seeding)
        pass
    return state


def set_rng_state(state: dict) -> None:
    """Restore `rng_state()` output."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
    if state["tracker"] is not None:
        get_cuda_rng_tracker().set_states(dict(state["tracker"]))


@contextlib.contextmanager
def rerun_context(start_state: Optional[dict]):
    """The re-run's RNG starts where the step started; training continues from the state it had after it."""
    after = rng_state()
    if start_state is not None:
        set_rng_state(start_state)
    try:
        yield
    finally:
        set_rng_state(after)


def _local_findings(chunks, rerun: Callable[[], None]) -> dict:
    """This rank's gradient scan and traced re-run (errors become a note; the collectives come after)."""
    modules = named_modules(chunks)
    out = {"rank": torch.distributed.get_rank(), "module": None, "position": None, "parameters": [],
           "count": 0, "error": None, "hook_calls": 0}
    try:
        found = nonfinite_gradients(modules)  # before the re-run (which runs under no_grad)
        with ForwardTrace(modules) as trace:
            rerun()
        params = backward_order(found, trace.last_use)
        out.update(parameters=params[:MAX_PARAMETERS], count=len(params), hook_calls=trace.calls)
        if trace.first is not None:
            out["position"], out["module"] = trace.first
    except Exception as exc:  # the monitor never breaks training
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def combine(findings: list[dict], step: int) -> dict:
    """One record from every rank's findings: the origin (module, else parameter, else the loss) and its rank."""
    with_module = [f for f in findings if f["module"] is not None]
    record = {"type": "non-finite", "step": step, "origin": "loss", "origin_kind": "loss", "origin_rank": None,
              "module": None, "module_rank": None,
              "modules_by_rank": {str(f["rank"]): f["module"] for f in with_module},
              "parameters": [], "nonfinite_parameters_by_rank": {str(f["rank"]): f["count"] for f in findings},
              "errors": {str(f["rank"]): f["error"] for f in findings if f["error"]}}
    if with_module:
        first = min(with_module, key=lambda f: (f["position"], f["rank"]))
        record.update(module=first["module"], module_rank=first["rank"], origin=first["module"],
                      origin_kind="module", origin_rank=first["rank"])
    seen: dict[str, list] = {}  # name -> [earliest backward-order key over the ranks, ranks]
    for f in sorted(findings, key=lambda f: f["rank"]):
        for name, *key in f["parameters"]:
            entry = seen.setdefault(name, [tuple(key), []])
            entry[0] = min(entry[0], tuple(key))
            entry[1].append(f["rank"])
    ordered = sorted(seen.items(), key=lambda item: (item[1][0], item[1][1][0]))
    record["parameters"] = [{"name": n, "ranks": ranks} for n, (_, ranks) in ordered][:MAX_PARAMETERS]
    if not with_module and record["parameters"]:
        first = record["parameters"][0]
        record.update(origin=first["name"], origin_kind="parameter", origin_rank=first["ranks"][0])
    return record


def locate(chunks, rerun: Callable[[], None], step: int) -> tuple[dict, int]:
    """Run on every rank of the world at an agreed non-finite step: (the combined record, this rank's hook calls)."""
    local = _local_findings(chunks, rerun)
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)
    return combine(gathered, step), local["hook_calls"]


def alert_text(record: dict) -> str:
    """`non-finite: origin <module / parameter / loss> (rank r)`."""
    rank = "" if record["origin_rank"] is None else f" (rank {record['origin_rank']})"
    return f"non-finite: origin {record['origin']}{rank}"
