"""Functions the harness calls in every rank after each test (world knows no FSDP: what to call
is given to it).

The pytest plugin passes the adapters' ``on_test_end`` (``RuntimeOptions.after_test``); the
runtime registers those functions in the pytest process (thread and launcher modes) and sends
them with every task to rank processes, which register them on receipt. They run before the
test's non-default process groups are destroyed. Functions must be importable (module level),
since they travel to rank processes by reference.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

_after_test: list[Callable[[], None]] = []
_lock = threading.Lock()


def add_after_test(functions: Iterable[Callable[[], None]]) -> None:
    """Register `functions` (each once) to run after every test in this process."""
    with _lock:
        for function in functions:
            if not callable(function):
                raise TypeError(f"after_test hook {function!r} is not callable")
            if function not in _after_test:
                _after_test.append(function)


def run_after_test() -> None:
    """Call every registered function, in registration order."""
    with _lock:
        functions = list(_after_test)
    for function in functions:
        function()
