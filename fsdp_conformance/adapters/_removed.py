"""Names removed from the adapter protocol before 1.0, each with what replaced it
(docs/adapters.md, "Removed names"), and the check that refuses an adapter still using one: a
class defining one, or a method reading or setting one on ``self`` or ``super()``."""

from __future__ import annotations

import dis
import inspect
from collections.abc import Iterator
from types import CodeType
from typing import Any

DOCS_SECTION = 'docs/adapters.md, "Removed names"'

# removed member of Adapter -> what replaced it
REMOVED_MEMBERS: dict[str, str] = {
    "unsupported": "declarations = Declarations(unsupported={feature: reason})",
    "unsupported_values": "Declarations(unsupported_values={(key, value): reason})",
    "known_deviations": "Declarations(known_deviations=(Deviation(...), ...))",
    "wrapper_segments": "Declarations(wrapper_segments=(...))",
    "grad_reduction": 'Declarations(grad_reduction="sum")',
    "instance_states": "Declarations(instance_states=False)",
    "delegates_to": "Declarations(delegates_to=other_adapter)",
    "support_problem": "Declarations(support=(SupportRange(...),)); "
    "features.support_problem(adapter) reads it",
    "capabilities": "features.capabilities(adapter)",
    "supports": "features.supports(adapter, *features)",
    "check": "features.require(adapter, *features)",
    "require": "features.skip_unless(adapter, *features)",
    "unsupported_reason": "features.why_unsupported(adapter, feature)",
    "features_for": "features.wrap_features(**config)",
    "_check_values": "features.require_values(adapter, config)",
    "find_deviation": "deviations.find_deviation(adapter, check, case, error)",
    "deviation": "deviations.deviation_reason(adapter, check, case)",
    "deviation_text": "deviations.deviation_text(adapter, deviation)",
    "delegation_chain": "deviations.delegation_chain(adapter)",
    "running_versions": "deviations.running_versions(adapter)",
    "delay_before_reduction": "adapter.wrapper(...).delay_before_reduction(delay)",
    "delay_before_free": "adapter.wrapper(...).delay_before_free(instance, delay)",
    "_optimizer_class": "base.optimizer_class(adapter, name)",
}
# removed name of the fsdp_conformance.adapters package -> what replaced it
REMOVED_EXPORTS: dict[str, str] = {
    "EngineHooks": "Adapter: the training-loop hooks are its methods (super() reaches them)",
    "loop": "the Adapter methods: adapter.<hook>(...) for loop.<hook>(adapter, ...)",
    "CHECK_IDS": "fsdp_conformance.checks.CHECKS (check id -> Check, .description)",
}


class RemovedNameError(ImportError, ValueError):
    """An adapter uses a name removed from the protocol: one line naming it, its replacement
    and the docs section (an ImportError for ``from ... import``, a ValueError for
    ``get_adapter``'s callers)."""


def removed_export(name: str) -> RemovedNameError:
    """The error for ``fsdp_conformance.adapters.<name>``, a removed package name."""
    return RemovedNameError(
        f"fsdp_conformance.adapters.{name} was removed: use {REMOVED_EXPORTS[name]} instead "
        f"({DOCS_SECTION})"
    )


def refuse_removed_names(adapter: Any) -> None:
    """RemovedNameError when the Adapter subclass `adapter` (or an instance: its attributes
    too) defines a removed member, or a method of its own reads or sets one on ``self`` or
    ``super()``."""
    classes = [adapter] if isinstance(adapter, type) else type(adapter).__mro__
    uses: dict[str, list[str]] = {}
    if not isinstance(adapter, type):
        for name in set(getattr(adapter, "__dict__", ())) & set(REMOVED_MEMBERS):
            uses.setdefault(name, []).append("set on the instance")
    for cls in classes:
        if cls.__module__ == __package__ + ".base":  # Adapter itself
            continue
        for name, value in vars(cls).items():
            if name in REMOVED_MEMBERS:
                uses.setdefault(name, []).append(f"defined by {cls.__name__}")
            for code in _codes(value):
                for used in _self_attributes(code):
                    uses.setdefault(used, []).append(f"used in {cls.__name__}.{name}")
    if uses:
        owner = adapter if isinstance(adapter, type) else type(adapter)
        parts = [
            f"{name!r} ({', '.join(dict.fromkeys(where))}): use {REMOVED_MEMBERS[name]}"
            for name, where in sorted(uses.items())
        ]
        raise RemovedNameError(
            f"adapter {owner.__module__}.{owner.__qualname__} uses a member removed from the "
            f"Adapter protocol: {'; '.join(parts)} ({DOCS_SECTION})"
        )


def _codes(value: Any) -> Iterator[CodeType]:
    """The code objects of a class attribute (a function, static/class method or property)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    functions = (value.fget, value.fset, value.fdel) if isinstance(value, property) else (value,)
    for function in functions:
        if inspect.isfunction(function):
            yield function.__code__


_SELF_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_CLOSURE"})
_ATTRIBUTE_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR"})
_CALLS = frozenset({"CALL", "CALL_FUNCTION", "PRECALL"})


def _self_attributes(code: CodeType, self_name: str | None = None) -> Iterator[str]:
    """Removed members `code` (and the functions nested in it) reads or sets on its first
    argument or on ``super()`` (Python 3.10 to 3.12 bytecode: ``super().x`` is ``LOAD_GLOBAL
    super``, a call without arguments and ``LOAD_ATTR x`` before 3.12, ``LOAD_SUPER_ATTR x``)."""
    if self_name is None and code.co_argcount:
        self_name = code.co_varnames[0]
    receiver = None  # "self" or "super" when the previous instruction left it on the stack
    for instruction in dis.get_instructions(code):
        op, name = instruction.opname, instruction.argval
        if name in REMOVED_MEMBERS and (
            op == "LOAD_SUPER_ATTR" or (op in _ATTRIBUTE_OPS and receiver is not None)
        ):
            yield name
        if op in _SELF_LOADS and name == self_name:
            receiver = "self"
        elif (op == "LOAD_GLOBAL" and name == "super") or (
            op in _CALLS and instruction.arg == 0 and receiver == "super"
        ):
            receiver = "super"
        else:
            receiver = None
    for constant in code.co_consts:
        if isinstance(constant, CodeType):
            yield from _self_attributes(constant, self_name)
