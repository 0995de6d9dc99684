"""`get_adapter(name)`: resolve an adapter by name in whichever process asks (adapters are
never pickled): a built-in name, or "pkg.module:ATTR" naming an `Adapter` instance, subclass or
zero-argument factory."""

from __future__ import annotations

import importlib
import inspect
import threading

from fsdp_conformance import constants

from ._removed import RemovedNameError, refuse_removed_names
from .base import Adapter

# built-in name -> (module, class name), imported lazily
_BUILTIN: dict[str, tuple[str, str]] = {
    "impl": ("fsdp_conformance.adapters.impl", "ImplAdapter"),
    "torch-fsdp1": ("fsdp_conformance.adapters.torch_fsdp1", "TorchFSDP1Adapter"),
    "torch-fsdp2": ("fsdp_conformance.adapters.torch_fsdp2", "TorchFSDP2Adapter"),
    "fairscale": ("fsdp_conformance.adapters.fairscale", "FairscaleAdapter"),
    "deepspeed": ("fsdp_conformance.adapters.deepspeed", "DeepSpeedAdapter"),
}
BUILTIN_ADAPTERS = constants.BUILTIN_ADAPTERS

_cache: dict[str, Adapter] = {}  # one adapter object per name and process
# guards the cache only, never user code, so an adapter module may call get_adapter itself
_cache_lock = threading.Lock()
_resolving = threading.local()  # names this thread is resolving (a cycle is an error)


class AdapterImportError(ImportError):
    """An adapter's module exists but raised while being imported (a misspelt name is a
    ValueError)."""


def get_adapter(name: str) -> Adapter:
    """The adapter called `name` ("impl", "torch-fsdp1", "torch-fsdp2", "fairscale", "deepspeed"
    or "pkg.module:ATTR").

    Re-entrant (an adapter module may call it); threads resolving one name at once get the
    first object stored.

    Raises:
        ValueError: an unknown name, module or attribute, not an Adapter, or a name asking for
            itself; the message names the import path and the fix. Its subclass
            RemovedNameError: the adapter uses a name removed from the protocol.
        AdapterImportError: the adapter's module raised while being imported.
    """
    with _cache_lock:
        adapter = _cache.get(name)
    if adapter is not None:
        return adapter
    stack: list[str] = _resolving.__dict__.setdefault("names", [])
    if name in stack:
        raise ValueError(
            f"FSDP adapter {name!r} asks for itself while being resolved "
            f"({' -> '.join([*stack, name])}); resolve another adapter there"
        )
    stack.append(name)
    try:
        adapter = _resolve(name)
    finally:
        stack.pop()
    with _cache_lock:
        return _cache.setdefault(name, adapter)


def notify_test_end() -> None:
    """`Adapter.on_test_end` of every adapter resolved in this process (after each harness
    test)."""
    with _cache_lock:
        adapters = list(_cache.values())
    for adapter in adapters:
        adapter.on_test_end()


def _resolve(name: str) -> Adapter:
    if name in _BUILTIN:
        module_name, class_name = _BUILTIN[name]
        return getattr(importlib.import_module(module_name), class_name)()
    if ":" not in name:
        raise ValueError(
            f"unknown FSDP adapter {name!r}: use one of {', '.join(BUILTIN_ADAPTERS)} or "
            "'pkg.module:ATTR' naming an Adapter instance, subclass or factory "
            "(e.g. --fsdp-impl mypkg.fsdp_adapter:ADAPTER)"
        )
    module_name, _, attr_path = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except RemovedNameError:
        raise
    except Exception as error:
        # the module itself (or a package of it) missing is a misspelt name, not a broken adapter
        missing = error.name if isinstance(error, ModuleNotFoundError) else None
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise ValueError(
                f"FSDP adapter {name!r}: cannot import module {module_name!r} ({error}). "
                "Make it importable in every rank (install the package, or add its folder to "
                "PYTHONPATH) and check the spelling before the ':'"
            ) from error
        raise AdapterImportError(
            f"FSDP adapter {name!r}: importing module {module_name!r} failed: "
            f"{type(error).__name__}: {error}"
        ) from error
    target: object = module
    for part in attr_path.split("."):
        if not part or not hasattr(target, part):
            raise ValueError(
                f"FSDP adapter {name!r}: module {module_name!r} has no attribute {attr_path!r}. "
                f"Define it there (an Adapter instance, subclass or factory) or fix the name "
                "after the ':'"
            )
        target = getattr(target, part)
    adapter = _instantiate(target, name)
    refuse_removed_names(adapter)
    if not adapter.name or adapter.name == Adapter.name:
        adapter.name = name
    return adapter


def _instantiate(target: object, name: str) -> Adapter:
    if isinstance(target, Adapter):
        return target
    if inspect.isclass(target) and issubclass(target, Adapter):
        return target()
    if callable(target) and not inspect.isclass(target):
        try:
            produced = target()
        except TypeError as error:
            raise ValueError(
                f"FSDP adapter {name!r}: calling the factory failed ({error}); it must take no "
                "arguments"
            ) from error
        if isinstance(produced, Adapter):
            return produced
        raise ValueError(
            f"FSDP adapter {name!r}: the factory returned {type(produced).__name__}, not an "
            "fsdp_conformance.adapters.Adapter; return an instance of an Adapter subclass"
        )
    raise ValueError(
        f"FSDP adapter {name!r} resolves to {target!r}, which is not an "
        "fsdp_conformance.adapters.Adapter instance, subclass or factory; subclass Adapter"
    )
