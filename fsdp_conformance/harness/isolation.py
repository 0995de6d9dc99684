"""Per-test isolation: a :class:`StateSnapshot` of what a test may change in an interpreter
(environment, cwd, ``sys.path``, ``warnings`` filters, RNGs, torch's global settings and module
hooks, listeners of collectives), restored after each test; the threads a test leaves,
Python's and native ones (the gloo and nccl contexts of process groups that outlive their
destruction).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from fsdp_conformance import collective_observer


@dataclasses.dataclass
class StateSnapshot:
    """Interpreter state saved by :meth:`take`, put back by :meth:`restore`."""

    environ: dict[str, str]
    cwd: str
    sys_path: list[str]
    # entered by take(), exited by restore(): the warnings filters
    warnings_guard: Any
    torch_state: dict[str, Any]
    rng: tuple[Any, Any, Any]
    threads: frozenset[int]
    # threads of this process, native ones included (native_threads())
    native_threads: int
    # collective_observer's listeners (a test's CommTrace it did not exit, say)
    listeners: tuple[Any, ...]

    @classmethod
    def take(cls) -> StateSnapshot:
        guard = warnings.catch_warnings()
        guard.__enter__()
        return cls(
            environ=dict(os.environ),
            cwd=os.getcwd(),
            sys_path=list(sys.path),
            warnings_guard=guard,
            torch_state=_torch_state(),
            rng=rng_state(),
            threads=frozenset(t.ident for t in threading.enumerate() if t.ident is not None),
            native_threads=native_threads(),
            listeners=collective_observer.listeners(),
        )

    def restore(self, *, keep_warnings_guard: bool = True) -> None:
        """Put everything back; ``keep_warnings_guard`` re-enters a warnings guard so that the
        snapshot can be restored again."""
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.sys_path
        self.warnings_guard.__exit__(None, None, None)
        if keep_warnings_guard:
            self.warnings_guard = warnings.catch_warnings()
            self.warnings_guard.__enter__()
        _restore_torch_state(self.torch_state)
        restore_rng(self.rng)
        collective_observer.set_listeners(self.listeners)


def leftover_threads(snapshot: StateSnapshot) -> list[str]:
    """Non-daemon threads started after ``snapshot`` and still running (the controller then
    replaces the rank set)."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.ident not in snapshot.threads and t.is_alive() and not t.daemon
    )


# Threads a process may gain over ``StateSnapshot.native_threads`` without a report: pools torch
# starts on first use; a gloo process group's context runs 3 (2 workers and its TCP loop)
NATIVE_THREAD_SLACK = 24


def native_threads() -> int:
    """The threads of this process, Python's and native ones (0 where /proc is missing)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def leftover_native_threads(
    snapshot: StateSnapshot, rank: int, test: str = "the test"
) -> list[str]:
    """Once ``test``'s process groups were destroyed: one line when this process still runs more
    than ``NATIVE_THREAD_SLACK`` threads over ``snapshot`` after a garbage collection (which
    ends the groups an object cycle held), i.e. something still references the groups."""
    if native_threads() <= snapshot.native_threads + NATIVE_THREAD_SLACK:
        return []
    gc.collect()
    if (extra := native_threads() - snapshot.native_threads) <= NATIVE_THREAD_SLACK:
        return []
    why = "native: the gloo or nccl contexts of groups still referenced, e.g. by a global"
    return [
        f"{test} left {extra} more threads in rank {rank} after its groups were destroyed ({why})"
    ]


def _settings() -> dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]]:
    """torch's global settings a test may change: name -> (get, set); set is called only when
    the value changed (``use_deterministic_algorithms`` imports torch._inductor, seconds)."""
    import torch

    options = torch._tensor_str.PRINT_OPTS
    return {
        "dtype": (torch.get_default_dtype, torch.set_default_dtype),
        "device": (torch.get_default_device, _set_default_device),
        "grad": (torch.is_grad_enabled, torch.set_grad_enabled),
        "deterministic": (
            lambda: (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
        ),
        "anomaly": (
            lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            lambda v: torch.autograd.set_detect_anomaly(*v),
        ),
        "threads": (torch.get_num_threads, torch.set_num_threads),
        "print": (lambda: dict(vars(options)), lambda v: vars(options).update(v)),
    }


def _set_default_device(device: Any) -> None:
    """``torch.set_default_device``; the CPU as a fresh process has it: no device context at all
    (torch 2.8 keeps a None context, which its get_default_device then fails to read)."""
    import torch

    torch.set_default_device(None if device == torch.device("cpu") else device)
    local = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)
    if getattr(local, "device_context", False) is None:
        del local.device_context


def _torch_state() -> dict[str, Any]:
    from torch.nn.modules import module as hooks

    state = {name: get() for name, (get, _) in _settings().items()}
    state["hooks"] = {}
    for name in dir(hooks):
        if name.startswith("_global_") and name.endswith(("_hooks", "_hook", "_called")):
            value = getattr(hooks, name)
            state["hooks"][name] = value.copy() if isinstance(value, dict) else value
    return state


def _restore_torch_state(state: dict[str, Any]) -> None:
    from torch.nn.modules import module as hooks

    for name, (get, set_) in _settings().items():
        if get() != state[name]:
            set_(state[name])
    for name, saved in state["hooks"].items():
        current = getattr(hooks, name)
        if isinstance(saved, dict) and isinstance(current, dict):
            current.clear()
            current.update(saved)
        else:
            setattr(hooks, name, saved.copy() if isinstance(saved, dict) else saved)


def rng_state() -> tuple[Any, Any, Any]:
    import torch

    numpy = sys.modules.get("numpy")
    return torch.get_rng_state(), random.getstate(), numpy and numpy.random.get_state()


def restore_rng(state: tuple[Any, Any, Any]) -> None:
    import torch

    torch_state, random_state, numpy_state = state
    torch.set_rng_state(torch_state)
    random.setstate(random_state)
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)
