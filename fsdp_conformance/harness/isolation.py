"""Per-test isolation: a :class:`StateSnapshot` of what a test may change in an interpreter
(environment, cwd, ``sys.path``, ``warnings`` filters, RNGs, torch's default dtype and device,
grad mode, deterministic and anomaly modes, intra-op threads, print options, global module
hooks), taken before tests and restored after each. Threads a test left running
(:func:`leftover_threads`) make the controller replace a rank set.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import threading
import warnings
from typing import Any


@dataclasses.dataclass
class StateSnapshot:
    """Interpreter state saved by :meth:`take`, put back by :meth:`restore`."""

    environ: dict[str, str]
    cwd: str
    sys_path: list[str]
    # entered by take(), exited by restore(): saves and restores the warnings filters
    warnings_guard: Any
    torch_state: dict[str, Any]
    rng: tuple[Any, Any, Any]
    threads: frozenset[int]

    @classmethod
    def take(cls) -> StateSnapshot:
        """Save the current state (imports torch)."""
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
        )

    def restore(self, *, keep_warnings_guard: bool = True) -> None:
        """Put everything back as it was at :meth:`take`; ``keep_warnings_guard`` re-enters
        a warnings guard so that the snapshot can be restored again (rank processes)."""
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        try:
            if os.getcwd() != self.cwd:
                os.chdir(self.cwd)
        except OSError:
            os.chdir(self.cwd)
        sys.path[:] = self.sys_path
        self.warnings_guard.__exit__(None, None, None)
        if keep_warnings_guard:
            self.warnings_guard = warnings.catch_warnings()
            self.warnings_guard.__enter__()
        _restore_torch_state(self.torch_state)
        restore_rng(self.rng)


def leftover_threads(snapshot: StateSnapshot) -> list[str]:
    """Names of non-daemon threads started after ``snapshot`` and still running."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.ident not in snapshot.threads and t.is_alive() and not t.daemon
    )


def _module_hooks() -> Any:
    from torch.nn.modules import module as nn_module

    return nn_module


def _torch_state() -> dict[str, Any]:
    import torch

    hooks = _module_hooks()
    state: dict[str, Any] = {
        "dtype": torch.get_default_dtype(),
        "device": torch.get_default_device(),
        "grad": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "threads": torch.get_num_threads(),
        "print": dict(vars(torch._tensor_str.PRINT_OPTS)),
        "hooks": {},
    }
    for name in dir(hooks):
        if name.startswith("_global_") and name.endswith(("_hooks", "_hook", "_called")):
            value = getattr(hooks, name)
            state["hooks"][name] = value.copy() if isinstance(value, dict) else value
    return state


def _restore_torch_state(state: dict[str, Any]) -> None:
    import torch

    if torch.get_default_dtype() != state["dtype"]:
        torch.set_default_dtype(state["dtype"])
    if torch.get_default_device() != state["device"]:
        default = state["device"]
        torch.set_default_device(None if default == torch.device("cpu") else default)
    torch.set_grad_enabled(state["grad"])
    deterministic = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if deterministic != (state["deterministic"], state["deterministic_warn_only"]):
        # (only when changed: the call imports torch._inductor, seconds on first use)
        torch.use_deterministic_algorithms(
            state["deterministic"], warn_only=state["deterministic_warn_only"]
        )
    anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    if anomaly != state["anomaly"]:
        torch.autograd.set_detect_anomaly(*state["anomaly"])
    if torch.get_num_threads() != state["threads"]:
        torch.set_num_threads(state["threads"])
    options = torch._tensor_str.PRINT_OPTS
    if dict(vars(options)) != state["print"]:
        for key, value in state["print"].items():
            setattr(options, key, value)
    hooks = _module_hooks()
    for name, saved in state["hooks"].items():
        current = getattr(hooks, name)
        if isinstance(saved, dict):
            if isinstance(current, dict):
                current.clear()
                current.update(saved)
            else:
                setattr(hooks, name, saved.copy())
        else:
            setattr(hooks, name, saved)


def rng_state() -> tuple[Any, Any, Any]:
    import torch

    numpy = sys.modules.get("numpy")
    return (
        torch.get_rng_state(),
        random.getstate(),
        numpy.random.get_state() if numpy is not None else None,
    )


def restore_rng(state: tuple[Any, Any, Any]) -> None:
    import torch

    torch_state, random_state, numpy_state = state
    torch.set_rng_state(torch_state)
    random.setstate(random_state)
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)
