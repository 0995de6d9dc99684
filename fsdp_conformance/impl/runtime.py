"""Forward/backward hooks: unshard, reshard, prefetch, gradient reduction.

Per iteration, for each instance (FSDP1 order):
pre-forward: unshard (rate-limited all-gather), forward prefetch, wait, install views;
post-forward: reshard (FULL_SHARD, non-root), register pre-backward hooks on outputs;
pre-backward (first output gradient): unshard, ``BACKWARD_PRE`` prefetch, wait;
post-backward (flat gradient accumulated): reshard, ``BACKWARD_POST`` prefetch, issue
the reduce-scatter; at most one reduction stays in flight, the rest are finished;
end of backward (root's queued callback): finish reductions, reshard leftovers, IDLE.

Streams (CUDA; no-ops on CPU): all-gathers and their casts/copies run on the unshard
stream, reductions on the post-backward stream. The root's pre-forward makes both wait
for the compute stream (optimizer step). Memory allocated on one stream and released
while another still reads it is protected with ``record_stream``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map_only

from fsdp_conformance import vocab
from fsdp_conformance.impl import trace
from fsdp_conformance.impl.api import BackwardPrefetch, ShardingStrategy
from fsdp_conformance.impl.device import device_handle_for
from fsdp_conformance.impl.exec_order import ExecOrder
from fsdp_conformance.impl.flat_param import FlatParamHandle, PendingReduction
from fsdp_conformance.impl.limiter import FreeEventQueue
from fsdp_conformance.impl.state import HandleTrainingState, TrainingState, transition
from fsdp_conformance.vocab import Op

if TYPE_CHECKING:
    from fsdp_conformance.impl.fully_sharded import FullyShardedDataParallel as FSDP

# profiler range around the rate limiter's wait (same name as torch FSDP1)
RATE_LIMITER_RANGE = vocab.RATE_LIMITER_RANGE


class RootState:
    """State shared by all instances under one root, created at lazy init."""

    def __init__(self, root: FSDP, instances: list[FSDP], device_handle: Any) -> None:
        # the root instance
        self.root = root
        # every instance under the root, pre-order (root first)
        self.instances = instances
        # recorded execution orders and prefetch targets
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

    def create_streams(self, device_handle: Any) -> None:
        """(Re)create the side streams from ``device_handle``."""
        # stream the all-gathers (and their casts/copies) run on
        self.unshard_stream = device_handle.Stream()
        # stream the gradient reductions run on
        self.post_backward_stream = device_handle.Stream()

    def live_buffers(self) -> int:
        """Non-root all-gathered buffers currently allocated (see [Note: residency bound])."""
        return sum(
            1
            for instance in self.instances
            if not instance._is_root
            and instance._handle is not None
            and instance._handle.sharded
            and instance._handle.is_unsharded
        )


# ---------------------------------------------------------------------------- lazy init
def lazy_init(root: FSDP) -> None:
    """Make ``root`` the root of every instance under it (first forward)."""
    instances = type(root).fsdp_modules(root)
    for instance in instances[1:]:
        if instance._is_root:
            raise RuntimeError(
                f"FSDP instance at {instance._fsdp_name()} already ran forward as a root and is "
                f"now nested in {root._fsdp_name()}; construct all FSDP instances before the "
                "first forward"
            )
    handle = root._device_handle or device_handle_for(root.compute_device)
    state = RootState(root, instances, handle)
    names = {id(module): name for name, module in root.named_modules()}
    for instance in instances:
        instance._is_root = instance is root
        instance._device_handle = handle
        instance._root_state = state
        instance._fqn = _clean_name(names.get(id(instance), ""))
    mp = root.mixed_precision
    if mp is not None and mp.buffer_dtype is not None:
        for module in root.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    root._orig_buffer_dtypes[(id(module), name)] = buffer.dtype
                    module._buffers[name] = buffer.to(mp.buffer_dtype)


def _clean_name(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("._fsdp_wrapped_module", "")


# ---------------------------------------------------------------------------- unshard / reshard
def unshard(instance: FSDP, prefetch: str | None = None, early: bool = False) -> None:
    """Start unsharding ``instance`` (no-op if already unsharded or nothing to gather).

    Args:
        instance: the instance to unshard.
        prefetch: the prefetch direction if this is a prefetch, else None.
        early: the issuing instance still holds its own buffer (limiter's extra slot).
    """
    handle = instance._handle
    if handle is None or not handle.copies or handle.is_unsharded:
        return
    state = instance._root_state
    if instance.limit_all_gathers and handle.sharded:
        counted = not instance._is_root
        while (event := state.free_events.dequeue_if_needed(counted, early)) is not None:
            with torch.profiler.record_function(RATE_LIMITER_RANGE):
                trace.emit(Op.RATE_LIMITER_WAIT, instance, event=event)
                event.synchronize()
    with instance._device_handle.stream(state.unshard_stream):
        handle.issue_unshard(prefetch=prefetch)


def wait_unshard(instance: FSDP) -> None:
    """Make the unsharded parameters usable by the compute stream."""
    device = instance._device_handle
    instance._handle.wait_unshard(device)
    device.current_stream().wait_stream(instance._root_state.unshard_stream)


def reshard(instance: FSDP) -> None:
    """Free ``instance``'s unsharded buffer and hand the free event to the limiter."""
    handle = instance._handle
    if handle is None or not handle.copies or not handle.is_unsharded:
        return
    device = instance._device_handle
    if handle.all_gather_pending:
        wait_unshard(instance)
    if not handle.sharded:
        handle.free(device)
        return
    # observers hear of the free before it happens; the event they get is recorded right after
    free_event = device.Event()
    trace.emit(Op.FREE, instance, event=free_event)
    handle.free(device)
    free_event.record()
    if instance.limit_all_gathers:
        instance._root_state.free_events.enqueue(free_event)


def prefetch(instance: FSDP, direction: str) -> None:
    """Issue the next instance's all-gather (no-op if it is unsharded or done this phase)."""
    state = instance._root_state
    if direction == "forward":
        target = state.exec_order.forward_prefetch_target(instance)
        done = target is not None and target._ran_forward
    else:
        target = state.exec_order.backward_prefetch_target(instance)
        done = target is not None and (
            target._ran_post_backward or target._handle is None or not target._handle.requires_grad
        )
    if target is None or done or target._handle is None:
        return
    if not target._handle.copies or target._handle.is_unsharded:
        return
    own = instance._handle
    early = (
        direction != "backward_post"
        and not instance._is_root
        and own is not None
        and own.sharded
        and own.is_unsharded
    )
    trace.emit("prefetch", instance, target=target, direction=direction)
    unshard(target, prefetch=direction, early=early)


# ---------------------------------------------------------------------------- forward
def root_pre_forward(instance: FSDP) -> None:
    """Lazy init; at the start of an iteration, order the side streams after the step."""
    if instance._is_root is None:
        lazy_init(instance)
    if not instance._is_root:
        return
    state = instance._root_state
    for other in state.instances:
        if other.training_state == TrainingState.SUMMON_FULL_PARAMS:
            raise RuntimeError(
                f"forward of {instance._fsdp_name()} called inside summon_full_params of "
                f"{other._fsdp_name()}; exit the summon_full_params context before forward"
            )
    if instance.training_state != TrainingState.IDLE:
        return  # a second forward before backward: same iteration
    state.exec_order.next_iter()
    for other in state.instances:
        other._ran_forward = False
    current = instance._device_handle.current_stream()
    state.unshard_stream.wait_stream(current)
    state.post_backward_stream.wait_stream(current)


def check_same_instance_on_all_ranks(instance: FSDP) -> None:
    """First iteration only: every rank must be in the same instance's pre-forward.

    One small all-gather over the root's group per instance; a mismatch raises on every
    rank instead of letting mismatched all-gathers hang.
    """
    state = instance._root_state
    group = state.root.process_group
    if group.size() == 1:
        return
    index = torch.tensor([state.instances.index(instance)], dtype=torch.int64)
    gathered = [torch.empty_like(index) for _ in range(group.size())]
    dist.all_gather(gathered, index, group=group)
    indices = [int(t) for t in gathered]
    if len(set(indices)) > 1:
        running = ", ".join(
            f"rank {rank} runs {state.instances[i]._fsdp_name()}" for rank, i in enumerate(indices)
        )
        raise RuntimeError(
            f"FSDP execution order differs across ranks in the first forward ({running}); "
            "every rank must run the same FSDP instances in the same order"
        )


def pre_forward(instance: FSDP, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Unshard (and prefetch) before the wrapped module's forward."""
    instance._recomputing = instance.handle_training_state == HandleTrainingState.BACKWARD_PRE
    transition(instance, TrainingState.FORWARD_BACKWARD, "pre-forward")
    if not instance._recomputing:
        # a recompute stays in BACKWARD_PRE: non-reentrant checkpointing stops the recompute
        # early (once the saved tensors it needs exist), so its post-forward may never run
        # (found by the fuzzer: a checkpointed block holding wrapped instances, docs/fuzz.md)
        transition(instance, HandleTrainingState.FORWARD, "pre-forward")
    state = instance._root_state
    if state.exec_order.is_first_iter and not instance._recomputing:
        check_same_instance_on_all_ranks(instance)
        state.exec_order.record_pre_forward(instance)
    handle = instance._handle
    if handle is None:
        return args, kwargs
    unshard(instance)
    if instance.forward_prefetch and not instance._recomputing:
        prefetch(instance, "forward")
    wait_unshard(instance)
    handle.use_views(handle.unsharded)
    if handle.compute_dtype != handle.orig_dtype:
        dtype = handle.compute_dtype
        args, kwargs = tree_map_only(
            torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs)
        )
    return args, kwargs


def post_forward(instance: FSDP, output: Any) -> Any:
    """Reshard (FULL_SHARD, non-root) and hook the outputs for pre-backward."""
    if instance._recomputing:
        # activation-checkpoint recompute inside backward: the parameters are needed
        # for the gradient computation that follows, so keep them and stay in backward
        transition(instance, HandleTrainingState.BACKWARD_PRE, "post-forward (recompute)")
        return output
    state = instance._root_state
    state.exec_order.record_post_forward(instance)
    handle = instance._handle
    if (
        handle is not None
        and handle.strategy == ShardingStrategy.FULL_SHARD
        and not instance._is_root
    ):
        reshard(instance)
    instance._ran_forward = True
    transition(instance, HandleTrainingState.IDLE, "post-forward")
    tensors = [t for t in output_tensors(output) if t.requires_grad]
    if torch.is_grad_enabled():
        for tensor in tensors:
            tensor.register_hook(functools.partial(pre_backward_hook, instance))
    if instance._is_root and (not tensors or not torch.is_grad_enabled()):
        finish_iteration(instance)  # no backward will follow
    return output


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output: pytree containers and, inside them, dataclass
    instances (not pytree nodes unless registered; a module returning one must still get its
    pre-backward hooks -- found by the fuzzer, docs/fuzz.md)."""
    found = []
    for leaf in tree_flatten(output)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += output_tensors([getattr(leaf, field.name) for field in dataclasses.fields(leaf)])
    return found


# ---------------------------------------------------------------------------- backward
def pre_backward_hook(instance: FSDP, grad: torch.Tensor) -> None:
    """Runs when the gradient of one of ``instance``'s outputs is ready."""
    state = instance._root_state
    if not state.callback_queued:
        state.callback_queued = True
        Variable._execution_engine.queue_callback(functools.partial(finish_iteration, state.root))
    if instance._ran_pre_backward:
        return
    instance._ran_pre_backward = True
    transition(instance, HandleTrainingState.BACKWARD_PRE, "pre-backward hook")
    if instance._handle is None:
        return
    unshard(instance)
    if instance.backward_prefetch == BackwardPrefetch.BACKWARD_PRE:
        prefetch(instance, "backward_pre")
    wait_unshard(instance)


def post_backward_hook(instance: FSDP, unsharded: torch.Tensor) -> None:
    """Runs once the instance's whole unsharded gradient has been accumulated."""
    if instance.handle_training_state != HandleTrainingState.BACKWARD_PRE:
        transition(instance, HandleTrainingState.BACKWARD_PRE, "post-backward hook")
    transition(instance, HandleTrainingState.BACKWARD_POST, "post-backward hook")
    instance._ran_post_backward = True
    handle = instance._handle
    state = instance._root_state
    device = instance._device_handle
    reshard(instance)
    if instance.backward_prefetch == BackwardPrefetch.BACKWARD_POST:
        prefetch(instance, "backward_post")
    if not instance._sync_gradients:
        return  # no_sync(): keep accumulating the unsharded gradient
    state.post_backward_stream.wait_stream(device.current_stream())
    with device.stream(state.post_backward_stream):
        pending = handle.start_grad_reduction()
        if pending is not None:
            device.record_stream(pending.source, state.post_backward_stream)
    if pending is not None:
        state.pending_reductions.append((handle, pending))
    while len(state.pending_reductions) > 1:
        _finish_oldest_reduction(state, device)


def _finish_oldest_reduction(state: RootState, device: Any) -> None:
    handle, pending = state.pending_reductions.popleft()
    current = device.current_stream()
    current.wait_stream(state.post_backward_stream)
    device.record_stream(pending.output, current)
    handle.finish_grad_reduction(pending)


def finish_iteration(root: FSDP) -> None:
    """End of backward (or of a forward without backward): reshard all, back to IDLE."""
    state = root._root_state
    device = root._device_handle
    while state.pending_reductions:
        _finish_oldest_reduction(state, device)
    for instance in state.instances:
        reshard(instance)
        instance.handle_training_state = HandleTrainingState.IDLE
        if instance.training_state == TrainingState.FORWARD_BACKWARD:
            transition(instance, TrainingState.IDLE, "end of backward")
        instance._ran_pre_backward = False
        instance._ran_post_backward = False
    device.current_stream().wait_stream(state.post_backward_stream)
    state.callback_queued = False
    state.exec_order.end_first_iter()
