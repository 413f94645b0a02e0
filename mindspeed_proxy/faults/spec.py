"""`--inject-fault NAME[:key=value,...]`: parsing and validation of fault specifications."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# name -> {key: (type, default)}; `start` is the first optimizer step (1-based) the fault acts on
FAULTS: dict[str, dict[str, tuple[type, Any]]] = {
    "lr-spike": {"start": (int, 1), "x": (float, 10.0)},
    "router-bf16": {"start": (int, 1)},
    "small-gbs": {"start": (int, 1), "gbs": (int, 0)},
    "lowp-attention": {"start": (int, 1), "format": (str, "bf16"), "bits": (int, 0),
                       "rounding": (str, "nearest-even"), "targets": (str, "p+pv"), "block": (int, 64),
                       "seed": (int, 0)},
    "grad-overflow": {"start": (int, 1), "param": (str, "router"), "value": (str, "inf")},
    "nan-activation": {"start": (int, 1), "module": (str, ""), "value": (str, "nan"), "rank": (int, -1)},
    # RL loop only (mindspeed_proxy.rl.train): the train-inference mismatch faults
    "rollout-router-noise": {"start": (int, 1), "std": (float, 0.05), "seed": (int, 0)},
    "sampler-lowp": {"start": (int, 1), "format": (str, "bf16")},
    "policy-lag": {"start": (int, 1), "steps": (int, 2)},
}
RL_ONLY = ("rollout-router-noise", "sampler-lowp", "policy-lag")


@dataclass(frozen=True)
class FaultSpec:
    """One fault injector and its parameters."""

    name: str
    params: dict = field(default_factory=dict)

    def __getitem__(self, key: str):
        return self.params[key]

    def active(self, step: int) -> bool:
        """Whether the fault acts on optimizer step `step` (1-based)."""
        return step >= self.params["start"]


def parse_fault(text: str) -> FaultSpec:
    """Parse "NAME[:key=value,...]"; ValueError names the bad part and the known names/keys."""
    name, _, rest = text.partition(":")
    name = name.strip()
    if name not in FAULTS:
        raise ValueError(f"--inject-fault {text!r}: unknown fault {name!r}; known: {', '.join(FAULTS)}")
    schema = FAULTS[name]
    params = {key: default for key, (_, default) in schema.items()}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in schema:
            raise ValueError(f"--inject-fault {text!r}: bad parameter {item!r}; {name} takes "
                             f"{', '.join(f'{k}=' for k in schema)}")
        try:
            params[key] = schema[key][0](value)
        except ValueError:
            raise ValueError(f"--inject-fault {text!r}: {key}={value!r} is not a {schema[key][0].__name__}") from None
    if params["start"] < 1:
        raise ValueError(f"--inject-fault {text!r}: start must be >= 1")
    if name == "small-gbs" and params["gbs"] < 1:
        raise ValueError(f"--inject-fault {text!r}: small-gbs needs gbs=N (the global batch from `start` on)")
    if name == "lowp-attention":
        from mindspeed_proxy.faults.lowp_attention import FORMAT_MANTISSA_BITS, ROUND_TARGETS, ROUNDING_MODES

        bad = [t for t in params["targets"].split("+") if t not in ROUND_TARGETS]
        if params["format"] not in FORMAT_MANTISSA_BITS or params["rounding"] not in ROUNDING_MODES or bad \
                or not 0 <= params["bits"] <= 23 or params["block"] < 1:
            raise ValueError(f"--inject-fault {text!r}: format in {sorted(FORMAT_MANTISSA_BITS)}, bits in 0..23 "
                             f"(0 = from format), rounding in {list(ROUNDING_MODES)}, targets '+'-joined from "
                             f"{list(ROUND_TARGETS)}, block >= 1")
    if name == "sampler-lowp" and params["format"] not in ("bf16", "fp16"):
        raise ValueError(f"--inject-fault {text!r}: format must be bf16 or fp16")
    if name == "policy-lag" and params["steps"] < 1:
        raise ValueError(f"--inject-fault {text!r}: steps must be >= 1")
    if name == "rollout-router-noise" and params["std"] <= 0:
        raise ValueError(f"--inject-fault {text!r}: std must be > 0")
    if name == "nan-activation" and not params["module"]:
        raise ValueError(f"--inject-fault {text!r}: nan-activation needs module=NAME (e.g. "
                         "decoder.layers.1.self_attention)")
    if name in ("grad-overflow", "nan-activation") and params["value"] not in ("inf", "nan"):
        raise ValueError(f"--inject-fault {text!r}: value must be inf or nan")
    return FaultSpec(name, params)
