"""Lazy re-exports for package ``__init__`` modules that must not import torch at import time."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for package ``package`` resolving ``exports`` (name -> its
    module) on first access; a resolved name is cached in the package's namespace."""

    def __getattr__(name: str) -> Any:
        if (module := exports.get(name)) is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
