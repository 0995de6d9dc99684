"""Signal-safe cleanup. In pytest SIGTERM ends the session like Ctrl-C, so that the teardown
kills every rank and removes the temp directories. The CLI turns SIGINT and SIGTERM into
interrupts (``cli_signals``), forwards one SIGTERM to its pytest child, waits a bounded time,
then kills the child's process group; it ends within ``CLI_EXIT_BOUND_S``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

# The promise: SIGINT / SIGTERM to the CLI ends it within this many seconds, leaving nothing
CLI_EXIT_BOUND_S = 10.0
# Seconds the pytest child gets after the forwarded SIGTERM before its group is killed: the
# bound minus the kill, the ranks' exit on their parent's end (0.5 s) and room for a loaded host
CHILD_EXIT_WAIT_S = 6.0


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an interrupt so that ``finally`` blocks and teardown run."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(signum)


# config -> the SIGTERM handler that was installed before the session's
_previous: dict[int, Any] = {}


def install_pytest_handler(config: Any) -> None:
    """Make SIGTERM end the pytest session like Ctrl-C (main thread only; a handler the
    user installed is left alone)."""
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current not in (signal.SIG_DFL, None, _raise_terminated):
        return
    _previous[id(config)] = current
    signal.signal(signal.SIGTERM, _raise_terminated)


def uninstall_pytest_handler(config: Any) -> None:
    """Put back the SIGTERM handler :func:`install_pytest_handler` replaced."""
    previous = _previous.pop(id(config), None)
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def cli_signals() -> Iterator[None]:
    """Within the block SIGINT raises ``KeyboardInterrupt`` (even if the process was started
    with it ignored) and SIGTERM raises :class:`Terminated`; both handlers are put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    previous_term = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        signal.signal(signal.SIGINT, previous_int)


def stop_child(child: subprocess.Popen, interrupt: KeyboardInterrupt) -> int:
    """End the pytest ``child`` (its own session) after the CLI got ``interrupt``: one SIGTERM,
    ``CHILD_EXIT_WAIT_S`` to clean up, then SIGKILL to its process group. Returns the CLI's exit
    code (130 for SIGINT, 128 + the signal for SIGTERM)."""
    code = 128 + interrupt.signum if isinstance(interrupt, Terminated) else 130
    if child.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=CHILD_EXIT_WAIT_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)  # what is left of its group (xdist workers)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=2.0)
    return code
