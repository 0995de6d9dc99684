"""One ``FSDPState`` per instance, one ``RootContext`` per root, and the training states.

The free functions of ``runtime.py``, ``forward.py`` and ``state_dict.py`` take these objects,
never the module class (as torch FSDP2's ``FSDPState``). ``TrainingState`` (per instance object)
is the canonical ``RootState``; ``HandleTrainingState`` (per flat parameter) the canonical
``InstanceState``, whose table here is the canonical one plus ``IMPL_EXTRA_TRANSITIONS``.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fsdp_conformance import training_states
from fsdp_conformance.device_handle import DeviceHandle
from fsdp_conformance.training_states import InstanceState

from .api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from .exec_order import ExecOrder
from .flat_param import FlatParamHandle, PendingReduction
from .limiter import FreeEventQueue


class TrainingState(enum.Enum):
    """Coarse state of one instance object (FORWARD_BACKWARD: from its pre-forward until the
    end of the root's backward)."""

    IDLE = enum.auto()
    FORWARD_BACKWARD = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()


class HandleTrainingState(enum.Enum):
    """State of one instance's flat parameter."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()


_I = InstanceState
# Moves this implementation makes that the canonical instance table does not list:
IMPL_EXTRA_TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    # an activation-checkpoint recompute's post-forward runs inside backward and returns the
    # handle to BACKWARD_PRE, where its pre-/post-backward expect it (as torch FSDP1); the
    # suite's training-state checks run no checkpointing, so never sample it
    _I.FORWARD: frozenset({_I.BACKWARD_PRE}),
    # a handle whose post-backward never ran (no gradient): canonical only at the end of
    # backward; ``transition`` does not know its caller, and only that callback makes the move
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


HANDLE_TRANSITIONS: dict[HandleTrainingState, frozenset[HandleTrainingState]] = _derived_table(
    HandleTrainingState, training_states.LEGAL_INSTANCE_TRANSITIONS, IMPL_EXTRA_TRANSITIONS
)
TRAINING_TRANSITIONS: dict[TrainingState, frozenset[TrainingState]] = _derived_table(
    TrainingState, training_states.LEGAL_ROOT_TRANSITIONS, {}
)


@dataclass(eq=False)
class FSDPState:
    """The state of one ``FullyShardedDataParallel`` instance (compared by identity)."""

    owner: nn.Module  # the FullyShardedDataParallel module (what traces name)
    module: nn.Module  # the wrapped module
    # configuration: the constructor's arguments
    process_group: Any
    sharding_strategy: ShardingStrategy  # requested (a one-rank group runs NO_SHARD)
    cpu_offload: CPUOffload
    backward_prefetch: BackwardPrefetch | None
    mixed_precision: MixedPrecision | None
    forward_prefetch: bool
    limit_all_gathers: bool
    compute_device: torch.device
    handle: FlatParamHandle | None = None  # None: no parameters to manage
    training_state: TrainingState = TrainingState.IDLE
    handle_training_state: HandleTrainingState = HandleTrainingState.IDLE
    # set at the root's lazy init
    is_root: bool | None = None
    context: RootContext | None = None
    device_handle: DeviceHandle | None = None  # also set by install_device_handle
    fqn: str | None = None  # path from the root, wrapper segments removed
    # root only: (module id, buffer name) -> dtype before the mixed-precision buffer cast
    orig_buffer_dtypes: dict[tuple[int, str], torch.dtype] = field(default_factory=dict)
    # per iteration
    ran_forward: bool = False
    ran_pre_backward: bool = False
    ran_post_backward: bool = False
    recomputing: bool = False  # the current forward is an activation-checkpoint recompute
    sync_gradients: bool = True  # False inside no_sync()
    # inside summon_full_params: (full flat tensor, saved module attributes)
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
        self.root = root
        self.states = states  # pre-order, root first
        self.exec_order = ExecOrder()
        self.free_events = FreeEventQueue(self.live_buffers)
        # reductions issued but not yet accumulated, oldest first
        self.pending_reductions: collections.deque[tuple[FlatParamHandle, PendingReduction]] = (
            collections.deque()
        )
        self.callback_queued = False  # the end-of-backward callback is queued
        self.create_streams(device_handle)

    def create_streams(self, device_handle: DeviceHandle) -> None:
        self.unshard_stream = device_handle.Stream()  # all-gathers, their casts and copies
        self.post_backward_stream = device_handle.Stream()  # gradient reductions

    def live_buffers(self) -> int:
        """Non-root all-gathered buffers allocated now (see [Note: residency bound])."""
        return sum(
            1
            for state in self.states
            if not state.is_root
            and state.handle is not None
            and state.handle.sharded
            and state.handle.is_unsharded
        )


STATE_ATTRIBUTE = "_fsdp_state"


def state_of(module: nn.Module) -> FSDPState | None:
    """``module``'s ``FSDPState`` (None: not an FSDP instance)."""
    return module.__dict__.get(STATE_ATTRIBUTE)


def fsdp_states(module: nn.Module) -> list[FSDPState]:
    """The states of the FSDP instances in ``module``'s tree, pre-order."""
    return [m.__dict__[STATE_ATTRIBUTE] for m in module.modules() if STATE_ATTRIBUTE in m.__dict__]


def _attribute(state: TrainingState | HandleTrainingState) -> str:
    return "handle_training_state" if isinstance(state, HandleTrainingState) else "training_state"


def transition(
    state: FSDPState, new_state: TrainingState | HandleTrainingState, where: str
) -> None:
    """Move ``state`` to ``new_state``; RuntimeError naming ``where`` if the move is illegal."""
    attribute = _attribute(new_state)
    table = HANDLE_TRANSITIONS if attribute == "handle_training_state" else TRAINING_TRANSITIONS
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
    """AssertionError unless ``state`` is in one of ``states`` (one state or an iterable; each
    compared with the attribute of its own type)."""
    wanted = [states] if isinstance(states, enum.Enum) else list(states)
    if any(getattr(state, _attribute(expected)) == expected for expected in wanted):
        return
    names = [f"{type(s).__name__}.{s.name}" for s in wanted]
    raise AssertionError(
        f"FullyShardedDataParallel at {state.name()} expected to be in {names} but is in "
        f"training_state={state.training_state.name}, "
        f"handle_training_state={state.handle_training_state.name}"
    )
