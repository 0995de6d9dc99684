"""The reference FSDP's state: one ``FSDPState`` per instance, one ``RootContext`` per root,
and the training states with their legal transitions.

Every ``FullyShardedDataParallel`` module holds its ``FSDPState`` (``fsdp_states`` finds them);
the root's lazy init creates one ``RootContext`` that every state under it shares. The free
functions of ``runtime.py``, ``forward.py`` and ``state_dict.py`` take these objects, never the
module class (torch FSDP2 keeps its ``FSDPState`` and ``FSDPStateContext`` the same way).

Two training-state levels, named as in torch FSDP1:

- ``TrainingState``, one per instance object, coarse (IDLE, FORWARD_BACKWARD,
  SUMMON_FULL_PARAMS): the canonical ``training_states.RootState`` (the suite reads it on the
  root);
- ``HandleTrainingState``, the state of the instance's flat parameter: the canonical
  ``training_states.InstanceState`` (same names). ``HANDLE_TRANSITIONS`` is the canonical table
  plus ``IMPL_EXTRA_TRANSITIONS``, the two moves this implementation makes that the canonical
  table does not list (each with its reason below).
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fsdp_conformance import training_states
from fsdp_conformance.device_handle import DeviceHandle
from fsdp_conformance.impl.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_conformance.impl.exec_order import ExecOrder
from fsdp_conformance.impl.flat_param import FlatParamHandle, PendingReduction
from fsdp_conformance.impl.limiter import FreeEventQueue
from fsdp_conformance.training_states import InstanceState


class TrainingState(enum.Enum):
    """Coarse state of one instance object (torch FSDP1's ``TrainingState``; canonical
    ``RootState``)."""

    # Not inside forward/backward or summon_full_params
    IDLE = enum.auto()
    # From the instance's pre-forward until the end of the root's backward
    FORWARD_BACKWARD = enum.auto()
    # Inside summon_full_params
    SUMMON_FULL_PARAMS = enum.auto()


class HandleTrainingState(enum.Enum):
    """State of one instance's flat parameter: where in the step its parameters are (canonical
    ``InstanceState``)."""

    # Between phases (after post-forward, after backward, after optimizer.step())
    IDLE = enum.auto()
    # From pre-forward (unshard) to post-forward (reshard)
    FORWARD = enum.auto()
    # Transition to pre-backward when unsharding in backward
    BACKWARD_PRE = enum.auto()
    # Transition to post-backward when the flat parameter's gradient is ready
    BACKWARD_POST = enum.auto()
    # Inside summon_full_params
    SUMMON_FULL_PARAMS = enum.auto()


_I = InstanceState
# Where this implementation's handle table differs from the canonical instance table (in names
# of the canonical states; only additions):
IMPL_EXTRA_TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    # The post-forward of an activation-checkpoint recompute runs inside backward: it reshards
    # and puts the handle back to BACKWARD_PRE (not IDLE), so that the handle's coming
    # pre-backward and post-backward find it where backward left it (torch FSDP1 does the same).
    # The canonical table leaves this move out (FORWARD ends in IDLE there); the suite's
    # training-state checks (suite/states.py) run no activation checkpointing, so they never
    # sample it.
    _I.FORWARD: frozenset({_I.BACKWARD_PRE}),
    # End of backward for a handle whose parameters received no gradient (its post-backward
    # never ran): canonical only at the end of backward (END_OF_BACKWARD_TRANSITIONS);
    # ``transition`` does not know where it is called from, so the move is always allowed and
    # the end-of-backward callback is the only caller that makes it.
    **training_states.END_OF_BACKWARD_TRANSITIONS,
}


def _derived_table(
    state_type: type[enum.Enum],
    canonical: dict[Any, frozenset[Any]],
    extra: dict[Any, frozenset[Any]],
) -> dict[Any, frozenset[Any]]:
    """``canonical`` plus ``extra``, in the states of ``state_type`` (matched by name)."""
    table = {}
    for source, targets in canonical.items():
        names = {target.name for target in targets | extra.get(source, frozenset())}
        table[state_type[source.name]] = frozenset(state_type[name] for name in names)
    return table


# legal handle transitions: state -> states it may move to
HANDLE_TRANSITIONS: dict[HandleTrainingState, frozenset[HandleTrainingState]] = _derived_table(
    HandleTrainingState, training_states.LEGAL_INSTANCE_TRANSITIONS, IMPL_EXTRA_TRANSITIONS
)

# legal coarse transitions: state -> states it may move to (the canonical root table)
TRAINING_TRANSITIONS: dict[TrainingState, frozenset[TrainingState]] = _derived_table(
    TrainingState, training_states.LEGAL_ROOT_TRANSITIONS, {}
)


# ------------------------------------------------------------------------------ state objects
@dataclass(eq=False)
class FSDPState:
    """The state of one ``FullyShardedDataParallel`` instance (compared by identity)."""

    # - Identity
    # the FullyShardedDataParallel module (what traces and observers name)
    owner: nn.Module
    # the wrapped module
    module: nn.Module

    # - Configuration (the constructor's arguments, checked there)
    # process group the flat parameter is sharded over
    process_group: Any
    # requested sharding strategy (a one-rank group runs NO_SHARD)
    sharding_strategy: ShardingStrategy
    # CPU offload configuration
    cpu_offload: CPUOffload
    # when the next instance is prefetched in backward (None: never)
    backward_prefetch: BackwardPrefetch | None
    # mixed precision configuration (None: full precision)
    mixed_precision: MixedPrecision | None
    # prefetch the next instance in pre-forward
    forward_prefetch: bool
    # rate-limit all-gathers with the free-event queue
    limit_all_gathers: bool
    # modules (with their descendants) FSDP does not manage
    ignored_modules: set[nn.Module]
    # device the computation runs on
    compute_device: torch.device
    # the flat parameter and its buffers (None: no parameters to manage)
    handle: FlatParamHandle | None = None

    # - Training states (legal moves: ``transition``)
    # coarse state of the instance object
    training_state: TrainingState = TrainingState.IDLE
    # state of the flat parameter
    handle_training_state: HandleTrainingState = HandleTrainingState.IDLE

    # - Set at the root's lazy init
    # None before lazy init, then whether this instance is the root
    is_root: bool | None = None
    # what this instance shares with the others under its root
    context: RootContext | None = None
    # device handle (streams, events); also set by install_device_handle
    device_handle: DeviceHandle | None = None
    # dotted path from the root with wrapper names removed
    fqn: str | None = None
    # root only: (module id, buffer name) -> dtype before the mixed-precision buffer cast
    orig_buffer_dtypes: dict[tuple[int, str], torch.dtype] = field(default_factory=dict)

    # - Per iteration
    # pre-forward ran since the iteration started
    ran_forward: bool = False
    # pre-backward hook ran in this backward
    ran_pre_backward: bool = False
    # post-backward hook ran in this backward
    ran_post_backward: bool = False
    # the current forward is an activation-checkpoint recompute
    recomputing: bool = False
    # False inside no_sync(): gradients accumulate unsharded, no reduction
    sync_gradients: bool = True
    # inside summon_full_params: (full flat tensor, saved module attributes), else None
    summon: tuple[torch.Tensor, list[tuple[nn.Module, str, Any]]] | None = None

    def name(self) -> str:
        """Where this instance is, for messages: ``'path' (WrappedType)``."""
        where = self.fqn if self.fqn else "<root>" if self.is_root else "<not yet initialized>"
        return f"'{where}' ({type(self.module).__name__})"


class RootContext:
    """What every instance under one root shares; created by the root's lazy init."""

    def __init__(
        self, root: FSDPState, states: list[FSDPState], device_handle: DeviceHandle
    ) -> None:
        # the root instance's state
        self.root = root
        # the state of every instance under the root, pre-order (root first)
        self.states = states
        # recorded execution orders and the prefetch targets they imply
        self.exec_order = ExecOrder()
        # the rate limiter's free-event queue
        self.free_events = FreeEventQueue(self.live_buffers)
        # gradient reductions issued but not yet accumulated, oldest first
        self.pending_reductions: collections.deque[tuple[FlatParamHandle, PendingReduction]] = (
            collections.deque()
        )
        # True once the end-of-backward callback is queued for this backward
        self.callback_queued = False
        self.create_streams(device_handle)

    def create_streams(self, device_handle: DeviceHandle) -> None:
        """(Re)create the side streams from ``device_handle``."""
        # stream the all-gathers (and their casts/copies) run on
        self.unshard_stream = device_handle.Stream()
        # stream the gradient reductions run on
        self.post_backward_stream = device_handle.Stream()

    def live_buffers(self) -> int:
        """Non-root all-gathered buffers currently allocated (see [Note: residency bound])."""
        return sum(
            1
            for state in self.states
            if not state.is_root
            and state.handle is not None
            and state.handle.sharded
            and state.handle.is_unsharded
        )


# the attribute of a FullyShardedDataParallel module holding its FSDPState
STATE_ATTRIBUTE = "_fsdp_state"


def state_of(module: nn.Module) -> FSDPState | None:
    """``module``'s ``FSDPState`` (None: ``module`` is no FSDP instance)."""
    return module.__dict__.get(STATE_ATTRIBUTE)


def fsdp_states(module: nn.Module) -> list[FSDPState]:
    """The states of the FSDP instances in ``module``'s tree, pre-order (outermost first)."""
    return [m.__dict__[STATE_ATTRIBUTE] for m in module.modules() if STATE_ATTRIBUTE in m.__dict__]


# ------------------------------------------------------------------------------ transitions
def transition(
    state: FSDPState, new_state: TrainingState | HandleTrainingState, where: str
) -> None:
    """Move ``state`` to ``new_state``, raising if the move is illegal.

    Args:
        state: the instance's ``FSDPState``.
        new_state: a ``TrainingState`` or ``HandleTrainingState``.
        where: the hook or method making the move (for the error message).
    """
    if isinstance(new_state, HandleTrainingState):
        attribute, table = "handle_training_state", HANDLE_TRANSITIONS
    else:
        attribute, table = "training_state", TRAINING_TRANSITIONS
    current = getattr(state, attribute)
    if current == new_state:
        return
    if new_state not in table[current]:
        allowed = sorted(s.name for s in table[current])
        raise RuntimeError(
            f"FullyShardedDataParallel at {state.name()}: illegal {attribute} "
            f"transition {current.name} -> {new_state.name} in {where}; from {current.name} "
            f"only {allowed} are allowed"
        )
    setattr(state, attribute, new_state)


def assert_state(state: FSDPState, states: Any) -> None:
    """Raise AssertionError unless ``state`` is in one of ``states``.

    Args:
        state: the instance's ``FSDPState``.
        states: a ``TrainingState``/``HandleTrainingState`` or an iterable of them; each is
            compared with the attribute of its own type.
    """
    wanted = [states] if isinstance(states, enum.Enum) else list(states)
    for expected in wanted:
        attribute = (
            "handle_training_state"
            if isinstance(expected, HandleTrainingState)
            else "training_state"
        )
        if getattr(state, attribute) == expected:
            return
    seen = f"training_state={state.training_state.name}, " + (
        f"handle_training_state={state.handle_training_state.name}"
    )
    raise AssertionError(
        f"FullyShardedDataParallel at {state.name()} expected to be in "
        f"{_names(wanted)} but is in {seen}"
    )


def _names(states: Iterable[enum.Enum]) -> list[str]:
    return [f"{type(s).__name__}.{s.name}" for s in states]
