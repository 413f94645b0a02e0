"""Resume a GRPO run from its own checkpoint (`--load DIR --rl-resume`): what the RL loop saves besides the Trainer.

The RL loop's checkpoint holds, as Stateful parts (training/checkpoint_parts.py) next to the model, optimizer,
scheduler and RNG that the Trainer's checkpointer writes:

- `mechanism_monitor` (rank-agnostic): the monitor's detectors (monitor/state.py);
- `rl_loop` (rank-agnostic, all-reduced values): the RL step, the optimizer-step count, the first step's
  expert load (the reference of `load_drift`) and the expert usage summed so far;
- `rl_reference` (per rank: this rank's parameter shards): the reference policy's weights (the KL term's
  anchor, the weights the run started from) and, with `policy-lag`, the lagged weight history.

Rollouts are drawn from (seed, step), so with these the resumed steps repeat the uninterrupted run's. Without
`--rl-resume`, `--load` reads the weights only (an SFT checkpoint or a proxy), as before.
"""
from __future__ import annotations

from typing import Optional

import torch

LOOP, REFERENCE = "rl_loop", "rl_reference"
VERSION = 1


def _tensor(value) -> Optional[torch.Tensor]:
    return None if value is None else torch.tensor(value, dtype=torch.float64)


class LoopPart:
    """The loop counters and all-reduced accumulators (`state` of rl.train.main), rank-agnostic."""

    def __init__(self, state: dict):
        self.state = state
        self.step = 0  # the RL step the checkpoint was written after (set by the loop before saving)

    def state_dict(self) -> dict:
        """Plain numbers: step, optimizer steps, first expert load and usage ([layers, experts] float64)."""
        first, usage = self.state.get("first_load"), self.state.get("usage")
        return {"version": VERSION, "step": self.step, "opt_step": self.state["opt_step"],
                "first_load": None if first is None else first.tolist(),
                "usage": None if usage is None else usage.tolist()}

    def load_state_dict(self, state: Optional[dict], where: str) -> None:
        """Restore the counters and accumulators; ValueError when `where` holds none (not an RL checkpoint)."""
        if state is None:
            raise ValueError(f"{where}: no RL loop state (--rl-resume needs a checkpoint the RL loop saved; "
                             "an SFT checkpoint or a proxy loads without it)")
        if state.get("version") != VERSION:
            raise ValueError(f"{where}: RL loop state version {state.get('version')!r} is not supported")
        self.step = int(state["step"])
        self.state["opt_step"] = int(state["opt_step"])
        for key in ("first_load", "usage"):
            self.state.pop(key, None)
            if state[key] is not None:
                self.state[key] = _tensor(state[key])


class ReferencePart:
    """This rank's reference-policy weights and lagged history (lists of tensors, parameters() order)."""

    per_rank = True

    def __init__(self, reference: list, history):
        self.reference, self.history = reference, history

    def state_dict(self) -> dict:
        """The tensors themselves (written as they are; the loop does not change them while saving)."""
        return {"version": VERSION, "reference": list(self.reference), "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: Optional[dict], where: str) -> None:
        """Copy the saved tensors into the live lists (shapes must match this rank's parameters)."""
        if state is None:
            raise ValueError(f"{where}: no reference-policy weights for this rank")
        if len(state["reference"]) != len(self.reference) or any(
                a.shape != b.shape for a, b in zip(state["reference"], self.reference)):
            raise ValueError(f"{where}: the saved reference weights do not match this model's parameters")
        for live, saved in zip(self.reference, state["reference"]):
            live.copy_(saved)
        self.history.clear()
        for weights in state["history"]:
            self.history.append([w.clone() for w in weights])


def parts(monitor, state: dict, reference: list, history) -> dict:
    """The RL loop's checkpoint parts by name (the monitor's only when it runs)."""
    from mindspeed_proxy.monitor.state import KEY, MonitorPart

    out = {LOOP: LoopPart(state), REFERENCE: ReferencePart(reference, history)}
    if monitor is not None:
        out[KEY] = MonitorPart(monitor, allow_side_file=False)
    return out


def load(args, trainer, named_parts: dict, prog: str) -> int:
    """Load `--load` with optimizer, RNG and `named_parts`; return the RL step to continue after (exit 2 on refusal)."""
    import sys

    from mindspeed_proxy.training import checkpointing as C

    try:
        C.loader(C.checkpoint_format(args.load))(args.load, trainer, load_optim=True, load_rng=True,
                                                  parts=named_parts)
    except ValueError as exc:
        if torch.distributed.get_rank() == 0:
            print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return named_parts[LOOP].step


def check(args) -> None:
    """ValueError naming --rl-resume when it has no --load to continue from."""
    if getattr(args, "rl_resume", False) and not args.load:
        raise ValueError("--rl-resume: needs --load DIR, the checkpoint of the RL run to continue")


def resume_iteration(args) -> int:
    """The optimizer steps already taken by the run `--load --rl-resume` continues (its saved RL step × steps
    per RL step), for the monitor's step counter before the optimizer exists; 0 without --rl-resume."""
    if not getattr(args, "rl_resume", False):
        return 0
    from mindspeed_proxy.training import checkpointing as C

    per_step = args.grpo_prompts_per_step * args.grpo_group_size * args.grpo_iterations // args.global_batch_size
    return C.read_tracker(args.load) * per_step
