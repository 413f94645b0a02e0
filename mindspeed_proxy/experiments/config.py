"""Typed schemas of the experiment YAMLs (fault matrix, RL fault matrix): every key named, every value typed.

`read_typed(path, Schema)` loads a YAML file and checks it against a dataclass schema: an unknown key, a
missing required key or a value of the wrong type is a ValueError of one line naming the file and the key
(`fault_matrix.yaml: original.ranks: expected int, got '2'`). The loaders (matrix.load_config,
rl_matrix.load_rl_config) go through it before they resolve anything. The proxy-fidelity experiment keeps
its settings in its script (examples/experiments/proxy_fidelity.py): it has no YAML.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Optional, Union

Scalar = Union[int, float, str]


@dataclass
class Model:
    """One side of a matrix: its launch and its experts."""

    ranks: int
    expert_parallel: int
    num_experts: int
    convert_args: list[str] = field(default_factory=list)  # the proxy's convert_to_proxy.py flags


@dataclass
class Phase:
    """A training phase: its optimizer steps and extra trainer flags."""

    iters: int
    args: list[str] = field(default_factory=list)


@dataclass
class Divergence:
    """report/divergence.py's rule."""

    warmup: int
    loss_factor: float
    grad_factor: float
    loss_window: int = 1
    persistence: int = 3


@dataclass
class E4:
    """The proxy-fidelity measurement of the fault matrix."""

    count_samples: int
    eval_samples: int
    random_seeds: list[int]


@dataclass
class Collapse:
    """Reward collapse: the `window`-step mean falls below `factor` x its mean before the onset."""

    window: int
    factor: float


@dataclass
class FaultMatrix:
    """examples/configs/fault_matrix.yaml."""

    train_args: list[str]
    original: Model
    proxy: Model
    warmup: Phase
    run: Phase
    monitor_config: str
    faults: dict[str, Optional[str]]
    expected_families: dict[str, list[str]]
    modes: dict[str, dict]  # each: top-level keys of this schema, checked as such
    env: dict[str, Scalar] = field(default_factory=dict)
    divergence: Optional[Divergence] = None
    e1_target_ratio: float = 0.5
    e4: Optional[E4] = None
    notes: list[str] = field(default_factory=list)


@dataclass
class MegatronLoop:
    """The train_rl.py loop of an RL matrix: Megatron-LM flags of the model, its SFT and its GRPO runs."""

    arch_args: list[str]  # model flags of pretrain_gpt.py and train_rl.py (--seq-length included)
    sft_args: list[str]   # pretrain_gpt.py's optimisation flags of the SFT start checkpoint
    rl_args: list[str]    # train_rl.py's GRPO, inference and monitor flags of every run
    sft_docs: int         # digit-task documents of the SFT data
    seq_length: int       # tokens per SFT document (prompt, answer, EOD, PADs): train_rl.py's --seq-length
    task: str = "reverse"
    partial_credit: float = 0.5
    sft_data_seed_offset: int = 1000  # the SFT documents' prompt stream: seed + offset (not an RL prompt stream)
    run_timeout_s: float = 1800.0     # a run past this is killed and recorded (exit 124)


@dataclass
class RLFaultMatrix:
    """examples/configs/rl_fault_matrix.yaml (our GRPO loop) and megatron_rl_fault_matrix.yaml (train_rl.py)."""

    original: Model
    proxy: Model
    tuning_seeds: list[int]
    heldout_seeds: list[int]
    sft_iters: int
    run_iters: int
    onset: int
    faults: dict[str, Optional[str]]
    expected_families: dict[str, list[str]]
    monitor_config: str
    false_alarms_per_1000_steps: float
    calibrate_form: str
    slots: int = 1
    r3_controls: list[str] = field(default_factory=list)
    collapse: Optional[Collapse] = None
    pearson_smoothing: int = 1
    e4_eval_prompts: int = 64
    notes: list[str] = field(default_factory=list)
    healthy_rl_seeds: dict[str, list[int]] = field(default_factory=dict)
    calibrate_config: Optional[str] = None
    task_args: list[str] = field(default_factory=list)  # our loop's task flags
    grpo_args: list[str] = field(default_factory=list)  # our loop's GRPO flags
    warmup_rl_iters: int = 0                            # our loop's GRPO warm-up before the conversion
    loop: str = "grpo"                                  # grpo: mindspeed_proxy.rl.train; train_rl: Megatron-LM's
    megatron: Optional[MegatronLoop] = None             # the train_rl loop's settings
    title: str = "RL fault matrix (GRPO): original vs proxy, held-out seeds"
    setup: Optional[str] = None                         # the page's per-seed paragraph (default: our loop's)


def _name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def check(value, tp, where: str):
    """`value` checked against type `tp` (dataclass, list[...], dict[str, ...], Optional/Union, scalar); returns it
    (a dataclass schema's mapping becomes that dataclass); ValueError naming `where` otherwise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return check(value, option, where)
            except ValueError as exc:
                errors.append(exc)
        raise errors[0] if len(errors) == 1 else ValueError(f"{where}: expected {_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping ({tp.__name__}), got {value!r}")
        return build(tp, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        return [check(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        return {check(k, args[0], f"{where} key"): check(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if tp is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and tp is not bool or not isinstance(value, tp):
        raise ValueError(f"{where}: expected {_name(tp)}, got {value!r}")
    return value


def build(schema, data: dict, where: str = ""):
    """The `schema` dataclass from mapping `data`: unknown keys, missing required keys and mistyped values are
    a ValueError naming the dotted key (prefixed by `where`)."""
    hints = typing.get_type_hints(schema)
    prefix = f"{where}." if where else ""
    unknown = [k for k in data if k not in hints]
    if unknown:
        raise ValueError(f"{prefix}{unknown[0]}: unknown key (known: {', '.join(hints)})")
    missing = [f.name for f in dataclasses.fields(schema) if f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{prefix}{missing[0]}: missing")
    return schema(**{k: check(v, hints[k], prefix + k) for k, v in data.items()})


def check_overrides(schema, modes: dict) -> None:
    """Each mode's overrides name top-level keys of `schema` with values of their types."""
    hints = typing.get_type_hints(schema)
    for mode, overrides in modes.items():
        for key, value in (overrides or {}).items():
            if key not in hints or key == "modes":
                raise ValueError(f"modes.{mode}.{key}: unknown key (known: {', '.join(hints)})")
            check(value, hints[key], f"modes.{mode}.{key}")


def read_typed(path, schema):
    """The raw mapping of YAML file `path` after checking it against `schema`; ValueError of one line naming the
    file and the key."""
    import yaml

    name = os.path.basename(str(path))
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{name}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{name}: expected a mapping at the top level")
    try:
        typed = build(schema, data)
        if hasattr(typed, "modes"):
            check_overrides(schema, typed.modes)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    return data
