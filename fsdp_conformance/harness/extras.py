"""Optional packages the built-in adapters need, and whether they import here (torch-free until
one of them is asked for): what the CLI, the pytest plugin and repro.py refuse an adapter by
before anything starts."""

from __future__ import annotations

import importlib

# Built-in adapters that need an optional package: adapter -> (package, extra that installs it)
EXTRAS = {"fairscale": ("fairscale", "fairscale"), "deepspeed": ("deepspeed", "deepspeed")}


def missing_extra(impl: str) -> str | None:
    """Why the built-in adapter ``impl`` cannot run here -- its optional package does not import
    -- as one line naming the install command; None when it can (or needs no extra).

    The package is imported for real (as the adapter will import it in every rank), so a
    package that is present but broken is refused too.
    """
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
