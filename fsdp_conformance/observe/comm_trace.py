"""A per-phase trace of an FSDP implementation's communication, rendered one event per line.

[Note: comm trace]
``CommTrace`` is an adapter observer (feature ``comm_trace``): each reported ``all_gather``,
``free``, ``reduce_scatter`` / ``all_reduce`` becomes a ``CommEvent(phase, op, label, state)``;
``compute=True`` adds ``compute`` when an instance's wrapped module starts forward (after the
implementation's pre-forward). ``collectives=True`` also records every all-gather,
reduce-scatter and all-reduce this rank's thread issues -- through ``torch.distributed`` or as a
functional collective (DTensor) -- with its group's global ranks and its tensors' dtypes, in
``collectives`` (``observing_collectives``: [Note: collective observer]).
Labels are the instance's module path in the *unwrapped* model (``<root>`` for the root); the
state is the canonical instance state at the event, so an all-gather in ``IDLE`` during
forward/backward is a prefetch. Nothing nondeterministic reaches ``render()``, which the
prefetch-order goldens compare. The driver names the phases: ``with trace.phase(name):``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Self

import torch
import torch.distributed as torch_dist
from torch import nn

from fsdp_conformance import collective_observer
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters.base import clean_param_name, scoped_observer
from fsdp_conformance.adapters.features import Feature
from fsdp_conformance.constants import COMM_OPS, REDUCE_OPS, Op

# the phase of events outside any `phase()` block
NO_PHASE = "outside"
ROOT_LABEL = "<root>"


class CommEvent(NamedTuple):
    """One observed operation (``state``: "-" when the adapter keeps none for the instance)."""

    phase: str
    op: str
    label: str
    state: str

    def render(self) -> str:
        return f"{self.op} {self.label} {self.state}"


class Collective(NamedTuple):
    """One collective: its phase, what it does, its group's global ranks, its tensors' dtypes."""

    phase: str
    op: str
    ranks: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]


@contextlib.contextmanager
def observing_collectives(
    callback: Callable[[collective_observer.CollectiveCall], None],
    barrier: Callable[[], Any] | None = None,
    ops: Iterable[str] | None = (Op.ALL_GATHER, *REDUCE_OPS),
) -> Iterator[None]:
    """``callback(call)`` for each all-gather, reduce-scatter and all-reduce (`ops`; None: every
    collective) this rank issues while active (filtered by thread as [Note: observation] says).
    `barrier` (e.g. the test's ``dist.barrier``): run on entering and before leaving, so that
    every rank observes at once (ranks that are threads of one process see each other's
    collectives while those do not observe)."""
    with scoped_observer(lambda op, instance, info: callback(info["call"]), None) as observer:

        def listener(call: collective_observer.CollectiveCall) -> None:
            if ops is None or call.op in ops:
                observer(call.op, None, {"call": call})

        remove = collective_observer.add_listener(listener)
        try:
            if barrier is not None:
                barrier()
            yield
            if barrier is not None:
                barrier()
        finally:
            remove()


def instance_labels(adapter: Any, root: nn.Module) -> dict[int, str]:
    """id(instance) -> the path of the module it wraps in the unwrapped model, wrapper segments
    removed (ROOT_LABEL for the root): the same for every adapter and rank."""
    paths = {id(module): name for name, module in root.named_modules()}
    labels = {}
    for instance in adapter.instances(root):
        path = paths.get(id(adapter.unwrap(instance)), paths.get(id(instance), ""))
        path = clean_param_name(path + ".", adapter.declarations.wrapper_segments).rstrip(".")
        labels[id(instance)] = path if path and instance is not root else ROOT_LABEL
    return labels


class CommTrace:
    """Records ``CommEvent``s of ``root``'s instances while active (see [Note: comm trace])."""

    def __init__(
        self, adapter: Any, root: nn.Module, compute: bool = False, collectives: bool = False
    ) -> None:
        self.adapter = adapter
        self.root = root
        self.compute = compute
        self.record_collectives = collectives
        self.collectives: list[Collective] = []
        self.labels = instance_labels(adapter, root)
        self.instances = {id(i): i for i in adapter.instances(root)}
        self.events: list[CommEvent] = []
        self._phase = NO_PHASE
        self._entered: dict[str, None] = {}  # phases in the order first entered
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Self:
        self._stack.enter_context(self.adapter.observe(self._on_op, self.instances.values()))
        if self.record_collectives:
            self._stack.enter_context(observing_collectives(self._on_collective))
        if self.compute:
            for instance in self.instances.values():
                on_compute = functools.partial(self._on_compute, instance)
                hook = self.adapter.unwrap(instance).register_forward_pre_hook(on_compute)
                self._stack.callback(hook.remove)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the events inside the block under phase ``name``."""
        previous, self._phase = self._phase, name
        self._entered.setdefault(name)
        try:
            yield
        finally:
            self._phase = previous

    def _state(self, instance: nn.Module) -> str:
        if not adapter_features.supports(self.adapter, Feature.TRAINING_STATES):
            return "-"  # the implementation has no training states
        try:
            return str(self.adapter.training_state(instance).value)
        except ValueError:  # an instance without parameters keeps no state (torch FSDP1)
            return "-"

    def _on_op(self, op: str, instance: nn.Module, info: dict) -> None:
        # what every adapter with `comm_trace` reports (others, e.g. impl's `Op.PREFETCH`, dropped)
        if op not in COMM_OPS or id(instance) not in self.labels:
            return
        label = self.labels[id(instance)]
        self.events.append(CommEvent(self._phase, op, label, self._state(instance)))

    def _on_collective(self, call: collective_observer.CollectiveCall) -> None:
        ranks = () if call.group is None else torch_dist.get_process_group_ranks(call.group)
        self.collectives.append(Collective(self._phase, call.op, tuple(ranks), call.dtypes))

    def _on_compute(self, instance: nn.Module, module: nn.Module, args: Any) -> None:
        label = self.labels[id(instance)]
        self.events.append(CommEvent(self._phase, Op.COMPUTE, label, self._state(instance)))

    @property
    def phases(self) -> list[str]:
        """Every phase entered, in order (also those without events), then ``NO_PHASE`` if events
        were recorded outside every phase."""
        return list(dict.fromkeys([*self._entered, *(event.phase for event in self.events)]))

    def select(self, phase: str | None = None, ops: Iterable[str] | None = None) -> list[CommEvent]:
        """The events of ``phase`` (all phases if None) whose op is in ``ops`` (all if None)."""
        ops = None if ops is None else frozenset(ops)
        return [
            event
            for event in self.events
            if (phase is None or event.phase == phase) and (ops is None or event.op in ops)
        ]

    def count(self, op: str | Iterable[str], phase: str | None = None) -> int:
        """Number of ``op`` events (or of any of several ops) in ``phase``."""
        return len(self.select(phase, (op,) if isinstance(op, str) else tuple(op)))

    def render(self, ops: Iterable[str] | None = COMM_OPS) -> str:
        """A ``phase:`` line, then ``  op label state`` per event; a phase equal to the last one
        with the same suffix (``forward`` / ``backward``) renders as ``phase: same as <it>``."""
        lines = []
        last_of_kind: dict[str, tuple[str, list[str]]] = {}
        for phase in self.phases:
            events = [event.render() for event in self.select(phase, ops)]
            kind = phase.rsplit(" ", 1)[-1]
            if (previous := last_of_kind.get(kind)) is not None and previous[1] == events:
                lines.append(f"{phase}: same as {previous[0]}")
                continue
            last_of_kind[kind] = (phase, events)
            lines.append(f"{phase}:")
            lines.extend(f"  {event}" for event in events)
        return "\n".join(lines) + "\n"
