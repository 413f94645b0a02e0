"""The one table of every patch mindspeed-proxy applies to torch, megatron-core or MindSpeed.

Each row names its target by dotted path, the callable that builds the replacement from the
original, the megatron-core versions it is written for and the feature that needs it. Nothing is
patched at import time; `apply_feature()` applies the rows of one feature, once, and refuses an
unsupported megatron-core version with one line naming the version and the target.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# megatron-core releases the patched code paths are written against (checked against their source).
MEGATRON_CORE_SUPPORTED = ">=0.12.0,<0.17"


@dataclass(frozen=True)
class Patch:
    """One patch: `target` ("pkg.module:attr.sub") is replaced by `build(original)`."""

    target: str
    build: Callable[[Any], Any]
    feature: str
    versions: str = MEGATRON_CORE_SUPPORTED  # megatron-core versions; "" = not tied to megatron
    optional: bool = False  # skip silently when the target does not exist (e.g. TE-only symbols)
    description: str = ""


class UnsupportedVersionError(RuntimeError):
    """The installed megatron-core version is outside a patch's supported range."""


_REGISTRY: list[Patch] = []
_applied: dict[str, Any] = {}  # target -> original, for every applied patch
_MISSING = object()


def register(patch: Patch) -> Patch:
    """Add `patch` to the registry table (idempotent per target+feature)."""
    if not any(p.target == patch.target and p.feature == patch.feature for p in _REGISTRY):
        _REGISTRY.append(patch)
    return patch


def register_wrappers(rows, feature: str) -> None:
    """Register (target, wrapper builder, optional) rows of `feature`; the builder's docstring describes it."""
    for target, build, optional in rows:
        register(Patch(target, build, feature, optional=optional,
                       description=(build.__doc__ or "").strip().splitlines()[0]))


def table() -> list[Patch]:
    """Return every registered patch, in registration order."""
    return list(_REGISTRY)


def megatron_core_version() -> Version | None:
    """Return the installed megatron-core version, or None if it is not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    try:
        return Version(version("megatron-core"))
    except PackageNotFoundError:
        return None


def applies(patch: Patch, mcore: Version | None = None) -> bool:
    """Whether `patch` is written for the installed (or given) megatron-core version."""
    if not patch.versions:
        return True
    mcore = mcore if mcore is not None else megatron_core_version()
    return mcore is not None and mcore in SpecifierSet(patch.versions)


def resolve(target: str) -> tuple[Any, str, Any]:
    """Return (owner object, attribute name, current value) for a "module:attr.sub" target."""
    module_name, _, attr_path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    parts = attr_path.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1], getattr(owner, parts[-1], _MISSING)


def apply_feature(feature: str) -> list[str]:
    """Apply every registered patch of `feature` once; return the targets patched by this call."""
    done = []
    for patch in _REGISTRY:
        if patch.feature != feature or patch.target in _applied:
            continue
        if not applies(patch):
            raise UnsupportedVersionError(
                f"mindspeed-proxy: megatron-core {megatron_core_version()} is not supported by patch "
                f"{patch.target} (feature {feature}, written for megatron-core {patch.versions})"
            )
        try:
            owner, attr, original = resolve(patch.target)
        except (ImportError, AttributeError):
            if patch.optional:
                continue
            raise
        setattr(owner, attr, patch.build(None if original is _MISSING else original))
        _applied[patch.target] = original
        done.append(patch.target)
    return done


def revert_feature(feature: str) -> list[str]:
    """Undo every applied patch of `feature`, newest first (the originals come back); return the targets."""
    done = []
    for patch in reversed(_REGISTRY):
        if patch.feature != feature or patch.target not in _applied:
            continue
        owner, attr, _ = resolve(patch.target)
        original = _applied.pop(patch.target)
        if original is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)
        done.append(patch.target)
    return done


def applied() -> list[str]:
    """Return the targets patched so far in this process."""
    return list(_applied)
