"""A per-phase trace of an FSDP implementation's communication, rendered one event per line.

[Note: comm trace]
``CommTrace`` is an adapter observer (``adapter.observe``, feature ``comm_trace``): every
``all_gather``, ``free``, ``reduce_scatter`` / ``all_reduce`` the adapter reports becomes a
``CommEvent(phase, op, label, state)``; with ``compute=True`` a forward pre-hook on the module
each instance wraps adds a ``compute`` event when that module's own forward starts (after the
implementation's pre-forward: unshard, forward prefetch). The driver names the phases
(``with trace.phase("iteration 2 backward"): ...``).

With ``collectives=True`` the trace also records every collective of ``torch.distributed``
called while it is active (in this rank's thread, as [Note: observation] filters), with the
global ranks of the group it ran on, as a ``Collective(phase, op, ranks)`` in
``trace.collectives``: what really went over which group, whatever the adapter reports (an
implementation calling ``torch.distributed``'s functions; impl binds its own at import).

Labels are stable across ranks and runs: the instance's module path in the *unwrapped* model
(``module.1`` for ``NestedWrappedModule``'s wrapped ``Sequential``; ``<root>`` for the root),
with wrapper segments removed. The state is the canonical instance state (docs/adapters.md) at
the moment of the event, so an all-gather issued in ``IDLE`` during forward/backward was issued
for the instance *before its own hook ran*: a prefetch. Nothing nondeterministic (ranks, ids,
addresses, timings) reaches ``render()``, which is what the prefetch-order goldens compare.

    trace = CommTrace(adapter, root)
    with trace:
        for iteration in (1, 2, 3):
            with trace.phase(f"iteration {iteration} forward"):
                loss = model(x).sum()
            with trace.phase(f"iteration {iteration} backward"):
                loss.backward()
    print(trace.render())
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Self

import torch.distributed as torch_dist
from torch import nn

from fsdp_conformance import constants
from fsdp_conformance._patching import patch_attribute
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters.base import clean_param_name, scoped_observer
from fsdp_conformance.adapters.features import Feature
from fsdp_conformance.constants import Op

# The ops every adapter with `comm_trace` reports (others, e.g. impl's `Op.PREFETCH`, are dropped)
COMM_OPS = constants.COMM_OPS
# The gradient reductions (NO_SHARD all-reduces, the sharded strategies reduce-scatter)
REDUCE_OPS = constants.REDUCE_OPS
# Phase of events outside any `phase()` block (lazy init, optimizer step, ...)
NO_PHASE = "outside"
ROOT_LABEL = "<root>"


class CommEvent(NamedTuple):
    """One observed operation."""

    # the driver's phase name ("iteration 1 forward"), NO_PHASE outside any
    phase: str
    # "all_gather", "free", "reduce_scatter", "all_reduce" or "compute"
    op: str
    # the instance's module path in the unwrapped model (ROOT_LABEL for the root)
    label: str
    # canonical instance state at the event ("-" when the adapter keeps none for it)
    state: str

    def render(self) -> str:
        return f"{self.op} {self.label} {self.state}"


class Collective(NamedTuple):
    """One ``torch.distributed`` collective recorded by ``CommTrace(collectives=True)``."""

    # the driver's phase name, NO_PHASE outside any
    phase: str
    # Op.ALL_GATHER, Op.REDUCE_SCATTER or Op.ALL_REDUCE
    op: str
    # global ranks of the process group it ran on
    ranks: tuple[int, ...]


# torch.distributed's collectives (named after the op: all_gather, all_gather_single, ...) and
# what each does; a name a release lacks is skipped
DIST_COLLECTIVES = {
    **{f"{Op.ALL_GATHER}{end}": Op.ALL_GATHER for end in ("", "_single", "_into_tensor")},
    **{f"{Op.REDUCE_SCATTER}{end}": Op.REDUCE_SCATTER for end in ("", "_single", "_tensor")},
    str(Op.ALL_REDUCE): Op.ALL_REDUCE,
}
_COLLECTIVES_KEY = "fsdp-conformance comm trace: torch.distributed collectives"
# the callbacks of the active collective recorders, filtered by thread ([Note: observation])
_collective_observers: list[Callable[[str, Any, dict], None]] = []


def _patch_collectives() -> None:
    """Make each of ``DIST_COLLECTIVES`` report (op, its group's ranks) to the active recorders
    before it runs; installed once per process, a pass-through while none is active."""

    def make(op: str):
        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            signature = inspect.signature(original)

            @functools.wraps(original)
            def collective(*args: Any, **kwargs: Any) -> Any:
                if _collective_observers:
                    group = signature.bind_partial(*args, **kwargs).arguments.get("group")
                    group = torch_dist.group.WORLD if group is None else group
                    ranks = tuple(torch_dist.get_process_group_ranks(group))
                    for observer in list(_collective_observers):
                        observer(op, None, {"ranks": ranks})
                return original(*args, **kwargs)

            return collective

        return wrap

    for name, op in DIST_COLLECTIVES.items():
        if hasattr(torch_dist, name):
            patch_attribute(torch_dist, name, make(op), key=_COLLECTIVES_KEY)


@contextlib.contextmanager
def _observing_collectives(callback: Callable[[str, Any, dict], None]) -> Iterator[None]:
    _patch_collectives()
    with scoped_observer(callback, None) as observer:
        _collective_observers.append(observer)
        try:
            yield
        finally:
            _collective_observers.remove(observer)


def instance_labels(adapter: Any, root: nn.Module) -> dict[int, str]:
    """id(instance) -> its module path in the unwrapped model (ROOT_LABEL for the root).

    The path is that of the module the instance wraps (``adapter.unwrap(instance)``), with the
    segments FSDP wrappers insert removed, so it is the same for every adapter and rank.
    """
    paths = {id(module): name for name, module in root.named_modules()}
    labels = {}
    for instance in adapter.instances(root):
        wrapped = adapter.unwrap(instance)
        path = paths.get(id(wrapped), paths.get(id(instance), ""))
        path = clean_param_name(
            path + ".", adapter_features.declared(adapter).wrapper_segments
        ).rstrip(".")
        labels[id(instance)] = path if path and instance is not root else ROOT_LABEL
    return labels


class CommTrace:
    """Records ``CommEvent``s of ``root``'s instances while active (see [Note: comm trace]).

    Args:
        adapter: the adapter that wrapped ``root`` (needs feature ``comm_trace``).
        root: the wrapped model.
        compute: also record ``compute`` when each instance's wrapped module starts forward.
        collectives: also record ``torch.distributed``'s collectives with their groups
            (``collectives``).
    """

    def __init__(
        self, adapter: Any, root: nn.Module, compute: bool = False, collectives: bool = False
    ) -> None:
        self.adapter = adapter  # the adapter observed through
        self.root = root  # the wrapped model
        self.compute = compute  # record compute events too
        self.record_collectives = collectives  # record torch.distributed's collectives too
        self.collectives: list[Collective] = []  # those recorded, in order
        self.labels = instance_labels(adapter, root)  # id(instance) -> label
        self.instances = {id(i): i for i in adapter.instances(root)}  # id -> instance
        self.events: list[CommEvent] = []  # everything recorded, in order
        self._phase = NO_PHASE  # the phase events are recorded under now
        self._entered: list[str] = []  # phase names in the order first entered
        self._stack = contextlib.ExitStack()  # observer and hooks while active

    # ------------------------------------------------------------------ recording
    def __enter__(self) -> Self:
        self._stack.enter_context(self.adapter.observe(self._on_op, self.instances.values()))
        if self.record_collectives:
            self._stack.enter_context(_observing_collectives(self._on_collective))
        if self.compute:
            for instance in self.instances.values():
                module = self.adapter.unwrap(instance)
                hook = module.register_forward_pre_hook(self._compute_hook(instance))
                self._stack.callback(hook.remove)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the events inside the block under phase ``name``."""
        previous, self._phase = self._phase, name
        if name not in self._entered:
            self._entered.append(name)
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
        if op not in COMM_OPS or id(instance) not in self.labels:
            return
        label = self.labels[id(instance)]
        self.events.append(CommEvent(self._phase, op, label, self._state(instance)))

    def _on_collective(self, op: str, instance: Any, info: dict) -> None:
        self.collectives.append(Collective(self._phase, op, info["ranks"]))

    def _compute_hook(self, instance: nn.Module):
        def record_compute(module: nn.Module, args: Any) -> None:
            label = self.labels[id(instance)]
            self.events.append(CommEvent(self._phase, Op.COMPUTE, label, self._state(instance)))

        return record_compute

    # ------------------------------------------------------------------ reading
    @property
    def phases(self) -> list[str]:
        """Every phase entered, in the order first entered (also those that recorded no event),
        then ``NO_PHASE`` if events were recorded outside every phase."""
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
        ops = (op,) if isinstance(op, str) else tuple(op)
        return len(self.select(phase, ops))

    def render(
        self, phases: Iterable[str] | None = None, ops: Iterable[str] | None = COMM_OPS
    ) -> str:
        """One line per phase header (``phase:``) and per event (``  op label state``).

        A phase whose events equal the previous phase with the same suffix (``forward`` /
        ``backward``) renders as ``phase: same as <that phase>``: steady-state iterations stay
        one line each.
        """
        lines = []
        # "forward" / "backward" -> (phase, rendered events) of the last phase written out
        last_of_kind: dict[str, tuple[str, list[str]]] = {}
        for phase in self.phases if phases is None else phases:
            events = [event.render() for event in self.select(phase, ops)]
            kind = phase.rsplit(" ", 1)[-1]
            previous = last_of_kind.get(kind)
            if previous is not None and previous[1] == events:
                lines.append(f"{phase}: same as {previous[0]}")
                continue
            last_of_kind[kind] = (phase, events)
            lines.append(f"{phase}:")
            lines.extend(f"  {event}" for event in events)
        return "\n".join(lines) + "\n"
