"""Training-state recorder: every instance's canonical state at every hook, checked against the
transitions of ``fsdp_conformance/training_states.py``.

[Note: where the recorder samples]
A *sample* reads every instance's state (and the root state) and checks each change. Plain
module and autograd hooks, registered after the implementation's own, sample right after its
hook of the same kind: pre-forward (a pre-hook on the wrapped module, ``adapter.unwrap(X)``),
post-forward (a forward hook on X), pre-backward (a gradient hook on each output of X).
Post-backward is seen at the next sample (implementations keep BACKWARD_POST until the end of
backward); mid-hook states are transient and not sampled (torch FSDP2 2.13.0 sets a
prefetched instance to PRE_BACKWARD during the all-gather). The end of backward is an engine
callback queued from the first pre-backward sample that queues the sample once more, so it
follows every callback queued in backward, the implementation's own included. ``after_step()``
samples after ``optimizer.step()``; checks call ``sample(hook)`` around summon. Staying in a
state is legal; ``END_OF_BACKWARD_TRANSITIONS`` (BACKWARD_PRE -> IDLE, no gradient) are legal
at the end-of-backward sample only.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from fsdp_conformance import training_states
from fsdp_conformance._tensors import output_tensors
from fsdp_conformance.adapters import Adapter, Feature, clean_param_name
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.checks import CheckFailure
from fsdp_conformance.training_states import (
    LEGAL_INSTANCE_TRANSITIONS,
    LEGAL_ROOT_TRANSITIONS,
    InstanceState,
    RootState,
)

# violations kept (the first ones explain the rest)
MAX_VIOLATIONS = 20
FIGURES = ("instance", "hook", "state")  # of IllegalTrainingState
END_OF_BACKWARD = "end of backward"
_LEGAL_AT_END_OF_BACKWARD = {
    source: targets | training_states.END_OF_BACKWARD_TRANSITIONS.get(source, frozenset())
    for source, targets in LEGAL_INSTANCE_TRANSITIONS.items()
}


@dataclasses.dataclass(frozen=True)
class Violation:
    """One illegal state: where (``hook``: "pre_forward of module.1", ...), at which ``level``
    ("instance" or "root"), the state before (None at the first sample), seen and allowed."""

    instance: str
    hook: str
    level: str
    previous: str | None
    seen: str
    allowed: tuple[str, ...]

    def __str__(self) -> str:
        came_from = f" after {self.previous}" if self.previous is not None else ""
        return (
            f"instance {self.instance!r} at {self.hook}: {self.level} state {self.seen}"
            f"{came_from}; allowed: {', '.join(self.allowed)}"
        )


class IllegalTrainingState(CheckFailure):
    """The recorder saw states outside the canonical transitions (``training_states.py``):
    failure "illegal training state", figures ``instance``, ``hook`` and ``state`` (each the
    distinct values of the violations, joined by ", ")."""


class TrainingStateRecorder:
    """Samples and checks the canonical states of every instance of the wrapped `model` (see
    the Note)."""

    def __init__(self, adapter: Adapter, model: nn.Module) -> None:
        self.adapter = adapter
        self.model = model
        self.instances: list[nn.Module] = list(adapter.instances(model))
        segments = adapter.declarations.wrapper_segments
        names = {id(module): clean_param_name(n, segments) for n, module in model.named_modules()}
        self.names: dict[int, str] = {id(i): names.get(id(i)) or "<root>" for i in self.instances}
        self.root = self.instances[0] if self.instances else None
        # False: the implementation has no training states; nothing is read
        self.enabled = adapter_features.supports(adapter, Feature.TRAINING_STATES)
        self.last: dict[tuple[int, str], str] = {}  # (instance id, level) -> last state seen
        self.violations: list[Violation] = []
        self.samples = 0
        self.hooks_seen: set[str] = set()
        self.states_seen: dict[str, set[str]] = {name: set() for name in self.names.values()}
        self.root_states_seen: set[str] = set()
        self._handles: list[Any] = []
        self._end_of_backward_queued = False

    def __enter__(self) -> TrainingStateRecorder:  # noqa: PYI034
        for instance in self.instances:
            name = self.names[id(instance)]
            inner = self.adapter.unwrap(instance)
            pre_forward = functools.partial(self._pre_forward, name)
            self._handles.append(inner.register_forward_pre_hook(pre_forward))
            post_forward = functools.partial(self._post_forward, name)
            self._handles.append(instance.register_forward_hook(post_forward))
        self.sample("start")
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_forward(self, name: str, module: nn.Module, args: Any) -> None:
        self.sample("pre_forward", name)

    def _post_forward(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        self.sample("post_forward", name)
        if not torch.is_grad_enabled():
            return
        for tensor in output_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(functools.partial(self._pre_backward, name))

    def _pre_backward(self, name: str, grad: torch.Tensor) -> None:
        self.sample("pre_backward", name)
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        # the engine runs a callback queued by a callback after the pending ones
        torch.autograd.Variable._execution_engine.queue_callback(self._sample_end_of_backward)

    def _sample_end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        self.sample(END_OF_BACKWARD)

    def sample(self, hook: str, of: str | None = None) -> None:
        """Read every instance's state now and check each change; ``hook``: the kind of sample
        ("pre_forward", ...), ``of``: the name of the instance whose hook it is."""
        self.samples += 1
        self.hooks_seen.add(hook)
        if not self.enabled:
            return
        label = hook if of is None else f"{hook} of {of}"
        legal = _LEGAL_AT_END_OF_BACKWARD if hook == END_OF_BACKWARD else LEGAL_INSTANCE_TRANSITIONS
        for instance in self.instances:
            if (state := self._instance_state(instance)) is not None:
                self.states_seen[self.names[id(instance)]].add(str(state))
                self._check(instance, label, "instance", state, legal)
        if self.root is not None:
            root_state = RootState(self.adapter.root_state(self.root))
            self.root_states_seen.add(str(root_state))
            self._check(self.root, label, "root", root_state, LEGAL_ROOT_TRANSITIONS)

    def after_step(self) -> None:
        """Sample after optimizer.step(): every instance and the root must be IDLE.

        Raises:
            IllegalTrainingState: any violation so far (before the implementation's own checks
                in the next forward can hide it).
        """
        hook = "after optimizer.step"
        self.sample(hook)
        if not self.enabled:
            return
        for instance in self.instances:
            state = self._instance_state(instance)
            if state is not None and state != InstanceState.IDLE:
                self._record(instance, hook, "instance", None, state, ("IDLE",))
        if self.root is not None:
            if (root_state := RootState(self.adapter.root_state(self.root))) != RootState.IDLE:
                self._record(self.root, hook, "root", None, root_state, ("IDLE",))
        self.assert_legal()

    def assert_legal(self) -> None:
        """Raise IllegalTrainingState listing the (first) violations, if any."""
        if not self.violations:
            return
        shown = "\n".join(f"  {violation}" for violation in self.violations)
        more = " (first ones)" if len(self.violations) >= MAX_VIOLATIONS else ""
        seen = [(v.instance, v.hook, f"{v.level} {v.seen}") for v in self.violations]
        raise IllegalTrainingState(
            f"{len(self.violations)} illegal training states{more} seen by "
            f"{type(self).__name__} (adapter {self.adapter.name!r}):\n{shown}",
            "illegal training state",
            **{key: ", ".join(dict.fromkeys(values)) for key, values in zip(FIGURES, zip(*seen))},
        )

    def _instance_state(self, instance: nn.Module) -> InstanceState | None:
        if not self.adapter.declarations.instance_states:
            return None  # the implementation keeps root states only
        try:
            return InstanceState(self.adapter.training_state(instance))
        except ValueError:
            return None  # an instance without parameters keeps no instance state (FSDP1)

    def _check(self, instance: nn.Module, hook: str, level: str, state: Any, legal: dict) -> None:
        key = (id(instance), level)
        previous = self.last.get(key)
        self.last[key] = state
        if previous is None or previous == state:
            return
        allowed = legal[type(state)(previous)]
        if state not in allowed:
            ordered = sorted({str(previous), *(str(s) for s in allowed)})
            self._record(instance, hook, level, previous, state, tuple(ordered))

    def _record(
        self, instance: nn.Module, hook: str, level: str, previous: Any, seen: Any, allowed: tuple
    ) -> None:
        if len(self.violations) < MAX_VIOLATIONS:
            previous = None if previous is None else str(previous)
            name = self.names[id(instance)]
            self.violations.append(Violation(name, hook, level, previous, str(seen), allowed))
