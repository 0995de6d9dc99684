"""The optional packages built-in adapters need, checked (torch-free) before anything starts."""

from __future__ import annotations

import importlib

# adapter -> (package, the extra that installs it)
EXTRAS = {"fairscale": ("fairscale", "fairscale"), "deepspeed": ("deepspeed", "deepspeed")}


def missing_extra(impl: str) -> str | None:
    """Why the built-in adapter ``impl`` cannot run here (its package does not import, for
    real: a broken one is refused too), naming the install command; None when it can."""
    if impl not in EXTRAS:
        return None
    package, extra = EXTRAS[impl]
    try:
        importlib.import_module(package)
    except Exception as error:  # noqa: BLE001  any failure to import the package refuses it
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        return (
            f"adapter {impl!r} needs {package}, which cannot be imported here ({reason}); "
            f"install it with: pip install 'fsdp-conformance[{extra}]'"
        )
    return None
