"""The one table of every patch mindspeed-proxy applies to torch, megatron-core or MindSpeed.

Each row names its target by dotted path, the callable that builds the replacement from the
original, the versions it is written for (of torch for a torch target, else of megatron-core) and the
feature that needs it. Nothing is patched at import time. `rows_for()` is the one selection of the rows to
apply, used by every route (`apply_feature()` here, MindSpeed's patch manager in mindspeed_manager.py): it
refuses a megatron-core outside MEGATRON_CORE_SUPPORTED or a torch outside TORCH_SUPPORTED with one line
naming the version, where it was found and the supported range, and keeps the rows whose gate admits the
imported versions. An `optional` row whose target is absent is skipped, never created. `apply_feature()`
returns an `Applied` handle that puts every original back (`revert()`, or as a context manager).
"""
from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# megatron-core releases the patched code paths are written against (checked against their source).
MEGATRON_CORE_SUPPORTED = ">=0.12.0,<0.20"
# The lines where a target exists only on one side of a move (rows name the one that fits).
BEFORE_0_17 = ">=0.12.0,<0.17"
BEFORE_0_18 = ">=0.12.0,<0.18"
# torch releases the torch rows are written for (setup.py's floor; tested on 2.13.0).
TORCH_SUPPORTED = ">=2.4"
# Python each megatron-core line declares (pyproject `requires-python`); a checkout on PYTHONPATH bypasses pip's check.
PYTHON_REQUIRED = {">=0.17": ">=3.12", "<0.17": ">=3.10"}


@dataclass(frozen=True)
class Patch:
    """One patch: `target` ("pkg.module:attr.sub") is replaced by `build(original)`."""

    target: str
    build: Callable[[Any], Any]
    feature: str
    versions: str = MEGATRON_CORE_SUPPORTED  # of torch for a torch target, else of megatron-core; "" = any
    optional: bool = False  # skip silently when the target does not exist (e.g. TE-only symbols); never created
    description: str = ""
    create: bool = False  # an absent attribute is defined as build(None) (a name a module uses unguarded)

    @property
    def package(self) -> str:
        """Whose versions gate the row: "torch" for a target in torch, else "megatron-core"."""
        return "torch" if self.target.partition(":")[0].split(".")[0] == "torch" else "megatron-core"


class UnsupportedVersionError(RuntimeError):
    """The imported megatron-core version is outside MEGATRON_CORE_SUPPORTED (message: one line)."""


_REGISTRY: list[Patch] = []
_applied: dict[str, Any] = {}  # target -> original, for every applied patch
_MISSING = object()


def register(patch: Patch) -> Patch:
    """Add `patch` to the registry table (idempotent per target+feature); a target has one owning feature."""
    owners = {p.feature for p in _REGISTRY if p.target == patch.target} - {patch.feature}
    if owners:  # apply_feature patches a target once: a second feature's row would be skipped silently
        raise ValueError(f"patch target {patch.target} of feature {patch.feature} is already a row of feature "
                         f"{sorted(owners)[0]}: compose both in one wrapper of one feature")
    if not any(p.target == patch.target and p.feature == patch.feature for p in _REGISTRY):
        _REGISTRY.append(patch)
    return patch


def register_wrappers(rows, feature: str) -> None:
    """Register (target, wrapper builder, optional[, versions]) rows of `feature`; the builder's docstring
    describes it; without versions a row is written for every supported megatron-core line."""
    for target, build, optional, *versions in rows:
        register(Patch(target, build, feature, versions=versions[0] if versions else MEGATRON_CORE_SUPPORTED,
                       optional=optional, description=(build.__doc__ or "").strip().splitlines()[0]))


def table() -> list[Patch]:
    """Return every registered patch, in registration order."""
    return list(_REGISTRY)


def _package_info_path() -> str | None:
    """Path of the package_info.py of the `megatron.core` that is (or would be) imported, else None."""
    module = sys.modules.get("megatron.core.package_info")
    if module is not None:
        return getattr(module, "__file__", None)
    try:  # found on the path without importing anything (find_spec("megatron.core") would import `megatron`)
        top = sys.modules.get("megatron")
        locations = list(getattr(top, "__path__", None) or []) if top is not None else None
        if locations is None:
            top_spec = importlib.util.find_spec("megatron")
            locations = list(top_spec.submodule_search_locations or []) if top_spec is not None else []
        spec = importlib.machinery.PathFinder.find_spec("megatron.core", locations) if locations else None
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(location, "package_info.py")
        if os.path.isfile(path):
            return path
    return None


def _literal_fields(path: str) -> dict:
    """The literal top-level assignments of a package_info.py, read without running it (0.18+ runs git)."""
    fields = {}
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                fields[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return fields


def _version_from(fields: dict) -> Version | None:
    """The release of a package_info namespace: MAJOR.MINOR.PATCH+PRE_RELEASE (no VCS suffix), else __version__."""
    try:
        if all(k in fields for k in ("MAJOR", "MINOR", "PATCH")):
            return Version(f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}{fields.get('PRE_RELEASE', '')}")
        for key in ("__shortversion__", "__version__"):
            if isinstance(fields.get(key), str):
                return Version(Version(fields[key]).public)
    except InvalidVersion:
        return None
    return None


def megatron_core_version() -> Version | None:
    """Return the version of the `megatron.core` actually imported (its package_info), or None if there is none."""
    module = sys.modules.get("megatron.core.package_info")
    if module is not None:
        return _version_from(vars(module))
    path = _package_info_path()
    return None if path is None else _version_from(_literal_fields(path))


def within(version: Version, specifiers: str) -> bool:
    """Whether `version` (pre-releases included: a checkout of a release branch) satisfies `specifiers`."""
    return SpecifierSet(specifiers).contains(version, prereleases=True)


def check_supported(mcore: Version | None = None) -> Version:
    """Return the imported megatron-core version; raise UnsupportedVersionError (one line) if outside the range
    or if this Python is older than that megatron-core line needs."""
    mcore = mcore if mcore is not None else megatron_core_version()
    path = _package_info_path()
    where = f" (megatron.core from {os.path.dirname(path)})" if path else ""
    found = "no importable megatron.core" if mcore is None and not path else f"megatron-core {mcore}{where}"
    if mcore is None or not within(mcore, MEGATRON_CORE_SUPPORTED):
        raise UnsupportedVersionError(
            f"mindspeed-proxy: {found} is not supported; supported: megatron-core {MEGATRON_CORE_SUPPORTED}")
    python = Version(".".join(map(str, sys.version_info[:3])))
    needed = next(need for line, need in PYTHON_REQUIRED.items() if within(mcore, line))
    if not within(python, needed):
        raise UnsupportedVersionError(f"mindspeed-proxy: {found} needs Python {needed}, this is Python {python}")
    return mcore


def torch_version() -> Version | None:
    """The release of the torch that is (or would be) imported (no local suffix such as +cpu), else None."""
    module = sys.modules.get("torch")
    try:
        if module is not None and isinstance(getattr(module, "__version__", None), str):
            return Version(Version(module.__version__).public)
        from importlib.metadata import PackageNotFoundError, version

        return Version(Version(version("torch")).public)
    except (InvalidVersion, PackageNotFoundError, ImportError):
        return None


def check_torch(found: Version | None = None) -> Version:
    """Return the torch version; raise UnsupportedVersionError (one line) if outside TORCH_SUPPORTED."""
    found = found if found is not None else torch_version()
    if found is None or not within(found, TORCH_SUPPORTED):
        raise UnsupportedVersionError(f"mindspeed-proxy: torch {found} is not supported; supported: torch "
                                      f"{TORCH_SUPPORTED}")
    return found


def applies(patch: Patch, mcore: Version | None = None, torch: Version | None = None) -> bool:
    """Whether `patch` is written for the imported (or given) torch / megatron-core version."""
    if not patch.versions:
        return True
    if patch.package == "torch":
        found = torch if torch is not None else torch_version()
    else:
        found = mcore if mcore is not None else megatron_core_version()
    return found is not None and within(found, patch.versions)


def rows_for(feature: str) -> list[Patch]:
    """The rows of `feature` to apply here, in registration order, each route's one selection: the versions are
    checked first (UnsupportedVersionError, one line), then every row whose gate excludes them is left out (its
    target lives on another line). A feature none of whose rows is written for these versions is refused."""
    rows = [p for p in _REGISTRY if p.feature == feature]
    gated = [p for p in rows if p.versions]
    mcore = check_supported() if any(p.package == "megatron-core" for p in gated) else None
    found = check_torch() if any(p.package == "torch" for p in gated) else None
    kept = [p for p in rows if applies(p, mcore, found)]
    if rows and not kept:
        written = "; ".join(f"{p.target} written for {p.package} {p.versions}" for p in rows)
        raise UnsupportedVersionError(f"mindspeed-proxy: feature {feature} has no row for megatron-core {mcore}, "
                                      f"torch {found}: {written}")
    return kept


def resolve(target: str) -> tuple[Any, str, Any]:
    """Return (owner object, attribute name, current value) for a "module:attr.sub" target."""
    module_name, _, attr_path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    parts = attr_path.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1], getattr(owner, parts[-1], _MISSING)


class Applied(list):
    """The targets one apply call patched (a list), and the handle that reverts them: `revert()` puts every
    original back, newest first (an attribute the row added is removed); `with patches.apply(...):` reverts
    on leaving the block."""

    def __init__(self, targets=(), children=()):
        super().__init__(targets)
        self._children = list(children)
        self.reverted = False

    def add(self, other: "Applied") -> "Applied":
        """Take `other`'s targets and its revert into this handle; return self."""
        self.extend(other)
        self._children.append(other)
        return self

    def revert(self) -> list[str]:
        """Undo what this handle applied (once; later calls do nothing); return the targets put back."""
        if self.reverted:
            return []
        self.reverted = True
        done = []
        for child in reversed(self._children):
            done += child.revert()
        for target in reversed([t for t in self if t in _applied]):
            if not any(target in c for c in self._children):
                done.append(_restore(target))
        return done

    def __enter__(self) -> "Applied":
        return self

    def __exit__(self, *exc) -> None:
        self.revert()


def _restore(target: str) -> str:
    owner, attr, _ = resolve(target)
    original = _applied.pop(target)
    if original is _MISSING:
        delattr(owner, attr)
    else:
        setattr(owner, attr, original)
    return target


def apply_feature(feature: str) -> Applied:
    """Apply the rows `rows_for(feature)` selects, each once; return the Applied handle of the targets patched."""
    done = Applied()
    for patch in rows_for(feature):
        if patch.target in _applied:
            continue
        try:
            owner, attr, original = resolve(patch.target)
        except (ImportError, AttributeError):
            if patch.optional:
                continue
            raise
        if original is _MISSING and not patch.create:
            if patch.optional:
                continue  # documented: an optional row whose target is absent is skipped, not created
            raise AttributeError(f"patch target {patch.target} does not exist (feature {feature})")
        setattr(owner, attr, patch.build(None if original is _MISSING else original))
        _applied[patch.target] = original
        done.append(patch.target)
    return done


def revert_feature(feature: str) -> list[str]:
    """Undo every applied patch of `feature`, newest first (the originals come back); return the targets."""
    return [_restore(p.target) for p in reversed(_REGISTRY) if p.feature == feature and p.target in _applied]


def applied() -> list[str]:
    """Return the targets patched so far in this process."""
    return list(_applied)
