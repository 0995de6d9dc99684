"""The optional packages built-in adapters need, checked (torch-free) before anything starts."""

from __future__ import annotations

import importlib

# built-in adapters whose package, and the extra that installs it, bear the adapter's name
EXTRAS = ("fairscale", "deepspeed")


def missing_extra(impl: str) -> str | None:
    """Why the built-in adapter ``impl`` cannot run here (its package does not import, for
    real: a broken one is refused too), naming the install command; None when it can."""
    if impl not in EXTRAS:
        return None
    try:
        importlib.import_module(impl)
    except Exception as error:  # noqa: BLE001  any failure to import the package refuses it
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        return (
            f"adapter {impl!r} needs {impl}, which cannot be imported here ({reason}); "
            f"install it with: pip install 'fsdp-conformance[{impl}]'"
        )
    return None
