"""Optional dependencies: the setup.py extra that brings each, and one error line when one is missing.

`require(module, extra, needed_for)` imports an optional module where it is first needed; a missing one
raises `MissingExtra`, an ImportError whose message is one line naming the extra to install. The
command-line entry points (`mindspeed-proxy ...`, `convert_to_proxy.py`) print that line and exit 2.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# import name -> (distribution to name in the message, the setup.py extra that installs it)
PACKAGES = {
    "matplotlib": ("matplotlib", "report"),
    "markdown_it": ("markdown-it-py", "report"),
    "scipy": ("scipy", "report"),
    "sklearn": ("scikit-learn", "proxy"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "safetensors": ("safetensors", "hf"),
    "transformers": ("transformers", "hf"),
    "deepspeed": ("deepspeed", "deepspeed"),
    "yaml": ("pyyaml", "yaml"),
}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message is one line naming the extra."""


def missing_message(module: str, needed_for: str, extra: str | None = None) -> str:
    """The one line for a missing `module`: what needs it and the `pip install` that brings it."""
    dist, default_extra = PACKAGES.get(module, (module, None))
    extra = extra or default_extra
    hint = f"pip install 'mindspeed-proxy[{extra}]'" if extra else f"pip install {dist}"
    return f"{needed_for} needs the {dist} package, which is not installed ({hint})"


def require(module: str, needed_for: str, extra: str | None = None) -> ModuleType:
    """Import `module` (e.g. "scipy.stats"); `MissingExtra` with one line naming the extra when absent."""
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] != top:
            raise  # the package is there but something it imports is not: not ours to rename
        raise MissingExtra(missing_message(top, needed_for, extra)) from None
