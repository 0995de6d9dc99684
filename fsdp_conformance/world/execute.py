"""Running one test body inside a rank: import the test, seed, call, classify the outcome.

Shared by the process ranks (``rank_main``) and the thread ranks (``threads``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import random
import sys
import time
import traceback
import types
from collections.abc import Callable
from typing import Any

from fsdp_conformance.world import properties
from fsdp_conformance.world.protocol import (
    FAILED,
    PASSED,
    SKIPPED,
    XFAILED,
    InRank,
    RankMonkeyPatch,
    RankOutcome,
    TestTarget,
)

# -----------------------------------------------------------------------------
# Importing the test


def load_test_module(name: str, file: str | None) -> types.ModuleType:
    """Import the test module ``name`` from ``file``, with pytest's assertion rewriting.

    Reuses the module when it was already loaded from the same file (process mode keeps
    rank processes across tests); a module of the same name from another file replaces it.
    """
    if name == "__main__":  # a unittest script run as `python test_x.py`
        name = "__mp_main__"
    module = sys.modules.get(name)
    if module is not None and _same_file(getattr(module, "__file__", None), file):
        return module
    if file is None:
        return importlib.import_module(name)
    parent = name.rpartition(".")[0]
    if parent:
        try:
            importlib.import_module(parent)  # for relative imports in the test module
        except ImportError:
            pass  # pytest's importlib mode: synthetic package names
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load test module {name!r} from {file}")
    module = importlib.util.module_from_spec(spec)
    with open(file, "rb") as source_file:
        source = source_file.read()
    code = _compile_with_assert_rewriting(source, file)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)  # noqa: S102  (what importing the module does)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _same_file(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a == b
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _compile_with_assert_rewriting(source: bytes, file: str) -> types.CodeType:
    tree = ast.parse(source, filename=file)
    try:
        from _pytest.assertion import rewrite, util

        rewrite.rewrite_asserts(tree, source, file, None)
        util._reprcompare = _reprcompare  # rich `==` explanations, as pytest shows them
    except Exception:  # noqa: BLE001  pytest internals moved: plain asserts still work
        tree = ast.parse(source, filename=file)
    return compile(tree, file, "exec", dont_inherit=True)


class _AssertConfig:
    """The two things pytest's assertion explanations need from a Config."""

    def get_verbosity(self, verbosity_type: str | None = None) -> int:
        return 0

    def get_terminal_writer(self) -> Any:
        from _pytest._io import TerminalWriter

        return TerminalWriter(file=open(os.devnull, "w"))


def _no_highlighting(source: str, lexer: str = "python") -> str:
    """pytest's highlighter, for a run without a terminal: the source as it is."""
    return source


def _reprcompare(op: str, left: Any, right: Any) -> str | None:
    """pytest's rich comparison explanation, or None (the plain assertion message).

    ``_pytest.assertion.util.assertrepr_compare`` is private and has had two shapes in the
    supported range (pytest >= 8, < 10, pinned in pyproject.toml): ``(config, op, left,
    right, use_ascii=False)`` returning a list (pytest 8 to 9.1), and from pytest 9.2 ``(op,
    left, right, *, verbose, highlighter, assertion_text_diff_style, ...)`` without a config,
    returning an iterator of lines. Every parameter is passed by name, with the values a plain
    terminal-less run uses (verbosity 0, no highlighting, pytest's default "ndiff" style);
    ``tests/harness/test_protocol.py`` runs both shapes and the installed pytest. A parameter
    this function does not know drops the explanation rather than replacing the test's
    AssertionError with a TypeError.
    """
    from _pytest.assertion import util

    try:
        function = util.assertrepr_compare
        arguments = {
            "config": _AssertConfig(),
            "op": op,
            "left": left,
            "right": right,
            "verbose": 0,
            "highlighter": _no_highlighting,
            "assertion_text_diff_style": "ndiff",
        }
        kwargs = {}
        for name, parameter in inspect.signature(function).parameters.items():
            if name in arguments:
                kwargs[name] = arguments[name]
            elif parameter.default is inspect.Parameter.empty:
                return None  # a layout this module does not know
        lines = list(function(**kwargs) or ())
    except Exception:  # noqa: BLE001  pytest internals moved
        return None
    return "\n~".join(lines) if lines else None


def resolve_target(target: TestTarget) -> Callable[..., Any]:
    """Return the callable that runs the test body (a function or a bound method)."""
    module = load_test_module(target.module_name, target.module_file)
    owner: Any = module
    for attribute in target.class_path:
        owner = getattr(owner, attribute)
    if target.kind == "unittest":
        case = owner(target.function_name)
        return case.debug  # setUp, the test method, tearDown; exceptions propagate
    if target.class_path:
        owner = owner()  # pytest instantiates test classes without arguments, per test
    return getattr(owner, target.function_name)


# -----------------------------------------------------------------------------
# Per-test state


def seed_all(seed: int) -> None:
    """Seed torch (all devices), ``random`` and numpy (when importable)."""
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)


def build_kwargs(
    values: dict[str, Any],
    ctx: Any,
    wants_dist: bool = True,
    monkeypatches: list[Any] | None = None,
) -> dict[str, Any]:
    """Resolve :class:`InRank` fixture values in this rank; add ``dist`` if the test takes it.

    A :class:`RankMonkeyPatch` becomes a fresh ``pytest.MonkeyPatch``, appended to
    ``monkeypatches`` for the caller to undo after the test.
    """
    kwargs = {}
    for name, value in values.items():
        if isinstance(value, RankMonkeyPatch):
            import pytest

            value = pytest.MonkeyPatch()
            if monkeypatches is not None:
                monkeypatches.append(value)
        elif isinstance(value, InRank):
            extra = {}
            try:
                parameters = inspect.signature(value.factory).parameters
            except (TypeError, ValueError):
                parameters = {}
            if "dist" in parameters:
                extra["dist"] = ctx
            value = value.factory(*value.args, **value.kwargs, **extra)
        kwargs[name] = value
    if wants_dist:
        kwargs["dist"] = ctx
    return kwargs


# -----------------------------------------------------------------------------
# Calling and classifying


def call_and_classify(rank: int, body: Callable[[], Any]) -> RankOutcome:
    """Call ``body`` and turn its result or exception into a :class:`RankOutcome`."""
    start = time.perf_counter()
    with properties.collecting() as recorded:
        try:
            body()
        except BaseException as exc:  # noqa: BLE001  (everything is reported to the parent)
            outcome = classify_exception(rank, exc)
        else:
            outcome = RankOutcome(rank, PASSED)
    outcome.duration = time.perf_counter() - start
    outcome.properties = list(recorded)
    return outcome


def classify_exception(rank: int, exc: BaseException) -> RankOutcome:
    import unittest

    from _pytest.outcomes import Failed, Skipped, XFailed

    if isinstance(exc, Skipped):
        return RankOutcome(rank, SKIPPED, message=str(exc.msg))
    if isinstance(exc, unittest.SkipTest):
        return RankOutcome(rank, SKIPPED, message=str(exc))
    if isinstance(exc, XFailed):
        return RankOutcome(rank, XFAILED, message=str(exc.msg))
    if isinstance(exc, Failed) and not exc.pytrace:
        return RankOutcome(rank, FAILED, message=str(exc.msg))
    return RankOutcome(
        rank,
        FAILED,
        message=_one_line(exc),
        traceback=format_user_traceback(exc),
    )


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


_HARNESS_DIR = os.path.dirname(os.path.abspath(__file__))
_PLUGIN_FILE = os.path.join(os.path.dirname(_HARNESS_DIR), "plugin.py")
# the wrapper that records collectives (world/collectives.py): noise inside user tracebacks
_COLLECTIVES_FILE = os.path.join(_HARNESS_DIR, "collectives.py")


def format_user_traceback(exc: BaseException) -> str:
    """Format ``exc`` without the harness's leading frames and without unittest's frames
    (modules that set ``__unittest``, as unittest's own reports do)."""
    frames = []
    tb = exc.__traceback__
    leading = True
    while tb is not None:
        frame = tb.tb_frame
        filename = os.path.abspath(frame.f_code.co_filename)
        harness = os.path.dirname(filename) == _HARNESS_DIR or filename == _PLUGIN_FILE
        if leading and harness:
            tb = tb.tb_next
            continue
        leading = False
        if "__unittest" not in frame.f_globals and filename != _COLLECTIVES_FILE:
            frames.append((frame, tb.tb_lineno))
        tb = tb.tb_next
    report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    if frames:
        report.stack = traceback.StackSummary.extract(iter(frames))
    return "".join(report.format())
