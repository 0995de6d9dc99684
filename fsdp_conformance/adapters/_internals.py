"""Feature detection of another library's internals (``_fsdp1_internals.py``,
``_fsdp2_internals.py``): one error naming what is missing, the version running and the
releases verified."""

from __future__ import annotations

import importlib
from typing import Any


class InternalsProbe:
    """``moved`` / ``require`` / ``load`` for one internals module."""

    def __init__(self, label: str, path: str, error: type[Exception], verified_on: tuple[str, ...]):
        self.label = label  # e.g. "torch FSDP2"
        self.path = path
        self.error = error
        self.verified_on = verified_on

    def moved(self, what: str) -> Exception:
        """The one error for a missing internal."""
        import torch

        return self.error(
            f"{self.label} internals moved: {what} (torch {torch.__version__}; "
            f"{self.path} knows torch {', '.join(self.verified_on)}); "
            "use a supported torch (docs/compatibility.md) or teach that file the new shape"
        )

    def require(self, obj: Any, *names: str) -> None:
        """The error unless ``obj`` has every attribute in ``names``."""
        for name in names:
            if not hasattr(obj, name):
                owner = obj.__name__ if isinstance(obj, type) else type(obj).__name__
                raise self.moved(f"{owner}.{name} is missing")

    def load(self, module: str, name: str | None = None) -> Any:
        """``module`` (or its attribute ``name``), or the error naming it."""
        try:
            imported = importlib.import_module(module)
            return imported if name is None else getattr(imported, name)
        except (ImportError, AttributeError) as error:
            where = f"{module}.{name}" if name else module
            raise self.moved(f"{where} cannot be imported ({error})") from None
