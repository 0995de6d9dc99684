"""Signal-safe cleanup.

pytest side: SIGTERM (a CI cancel, ``timeout``) ends the session like Ctrl-C, so that the
runtime's normal teardown kills every rank and removes every ``fsdp-conformance-*`` temp
directory; the previous handler is put back when the session ends.

CLI side: ``fsdp-conformance run`` forwards SIGTERM / SIGINT to its pytest child, waits a
bounded time for it to clean up, then kills it; it never leaves the child behind.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

# Seconds the pytest child gets to end its ranks and remove its files after a forwarded
# signal, before it is killed.
CHILD_EXIT_WAIT_S = 20.0


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
def sigterm_interrupts() -> Iterator[None]:
    """Within the block SIGTERM raises :class:`Terminated` (a ``KeyboardInterrupt``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_child(child: subprocess.Popen, interrupt: KeyboardInterrupt) -> int:
    """End ``child`` after the CLI was interrupted; return the CLI's exit code.

    SIGTERM is forwarded at once. For Ctrl-C from a terminal the child got SIGINT too: it
    gets a moment before its own SIGINT (a second one would cut pytest's cleanup short).
    Then ``CHILD_EXIT_WAIT_S`` to clean up, then SIGKILL.

    Args:
        child: the pytest process.
        interrupt: the interrupt the CLI received (:class:`Terminated` for SIGTERM).
    """
    if isinstance(interrupt, Terminated):
        steps = [(interrupt.signum, CHILD_EXIT_WAIT_S)]
        code = 128 + interrupt.signum
    else:
        steps = [(None, 5.0), (signal.SIGINT, CHILD_EXIT_WAIT_S)]
        code = 130
    for signum, wait_s in [*steps, (signal.SIGKILL, 10.0)]:
        if child.poll() is not None:
            break
        if signum is not None:
            child.send_signal(signum)
        try:
            child.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        break
    return code
