"""Our registry rows through MindSpeed's patch manager (`mindspeed.patch_utils.MindSpeedPatchesManager`).

MindSpeed names a patch by dotted path and stacks a function whose name ends in `wrapper` as a decorator
of the original (ours all do), so our rows and MindSpeed's own patches on the same function compose. The rows
are the registry's one selection (`registry.rows_for`: the version checks, then each row's gate), as on the
direct route; an optional row whose module is absent (e.g. `megatron.training.*` on a megatron-core-only
install), or whose attribute is absent from a module already imported, is not registered, since the manager's
`apply_patches()` raises on it (ModuleNotFoundError / RuntimeError; it never creates an attribute unless asked).
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys

from mindspeed_proxy.patches.registry import rows_for


def mindspeed_manager():
    """MindSpeed's patch-manager class when `mindspeed.patch_utils` imports, else None."""
    if importlib.util.find_spec("mindspeed") is None:
        return None
    try:
        patch_utils = importlib.import_module("mindspeed.patch_utils")
    except ImportError:
        return None
    return getattr(patch_utils, "MindSpeedPatchesManager", None) or getattr(patch_utils, "PatchesManager", None)


def module_present(name: str) -> bool:
    """Whether module `name` exists, found on the path without importing it (only its top package is looked up)."""
    if name in sys.modules:
        return True
    parts = name.split(".")
    spec = importlib.util.find_spec(parts[0])
    for depth in range(2, len(parts) + 1):
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), list(spec.submodule_search_locations))
    return spec is not None


def dotted(target: str) -> str:
    """MindSpeed's spelling of a registry target: "pkg.mod:Cls.attr" -> "pkg.mod.Cls.attr"."""
    module, _, attr = target.partition(":")
    return f"{module}.{attr}"


def attribute_absent(target: str) -> bool:
    """Whether a target's module is imported already and lacks the attribute (never imports anything)."""
    module_name, _, attr_path = target.partition(":")
    owner = sys.modules.get(module_name)
    for part in attr_path.split(".") if owner is not None else ():
        if not hasattr(owner, part):
            return True
        owner = getattr(owner, part)
    return False


def register_with_mindspeed(manager, feature: str, arguments: bool = True) -> list[str]:
    """Register the rows `rows_for(feature)` selects with MindSpeed's manager by dotted path; return the paths.

    Versions outside the supported range raise UnsupportedVersionError (one line, as `apply_feature`); a row
    whose gate excludes them is left out; an optional row whose target is absent is skipped. `arguments=False`
    leaves out the rows that add our flags to Megatron-LM's parser (a MindSpeed feature adds them through
    `register_args` instead).
    """
    done = []
    for patch in rows_for(feature):
        if not arguments and patch.build.__name__ == "parse_args_wrapper":
            continue
        module = patch.target.partition(":")[0]
        if patch.optional and (not module_present(module) or attribute_absent(patch.target)):
            continue
        manager.register_patch(dotted(patch.target), patch.build)
        done.append(dotted(patch.target))
    return done


def mindspeed_has_applied(manager) -> bool:
    """Whether MindSpeed has applied its patches already (so rows registered now would wait forever)."""
    if any(getattr(p, "is_applied", False) for p in getattr(manager, "patches_info", {}).values()):
        return True
    adaptor = sys.modules.get("mindspeed.megatron_adaptor")
    return bool(getattr(adaptor, "_IS_FEATURES_PATCHED", False))


def registered_state(manager, target: str, build) -> str:
    """"applied", "registered" (waiting for apply_patches), "removed" or "absent" for one of our rows."""
    info = getattr(manager, "patches_info", {}).get(dotted(target))
    if info is None:
        return "absent"
    if not any(w is build for w in getattr(info, "wrappers", [])):
        return "removed"
    return "applied" if info.is_applied else "registered"
