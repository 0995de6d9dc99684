"""The hooks around the wrapped module's forward and backward (the lifecycle of docs/impl.md):
unshard, reshard, prefetch, gradient reduction; free functions of an ``FSDPState``.

On CUDA all-gathers and their casts/copies run on the unshard stream, reductions on the
post-backward stream; memory released while another stream may still read it is protected
with ``record_stream``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.utils._pytree import tree_map_only

from fsdp_conformance import constants
from fsdp_conformance._tensors import output_tensors
from fsdp_conformance.constants import Op

from . import trace
from .api import BackwardPrefetch, ShardingStrategy
from .device import device_handle_for
from .state import (
    FSDPState,
    HandleTrainingState,
    RootContext,
    TrainingState,
    fsdp_states,
    transition,
)


def lazy_init(root: FSDPState) -> None:
    """Make ``root`` the root of every instance under it (first forward)."""
    states = fsdp_states(root.owner)
    for state in states[1:]:
        if state.is_root:
            raise RuntimeError(
                f"FSDP instance at {state.name()} already ran forward as a root and is "
                f"now nested in {root.name()}; construct all FSDP instances before the "
                "first forward"
            )
    for state in states:
        if state.handle is not None:
            state.handle.follow_flat_param()
            state.compute_device = state.handle.compute_device
    handle = root.device_handle or device_handle_for(root.compute_device)
    context = RootContext(root, states, handle)
    names = {id(module): name for name, module in root.owner.named_modules()}
    for state in states:
        state.is_root = state is root
        state.device_handle = handle
        state.context = context
        # path from the root without the wrapper's segments
        path = names.get(id(state.owner), "")
        state.fqn = path.replace("_fsdp_wrapped_module.", "").replace("._fsdp_wrapped_module", "")
    mp = root.mixed_precision
    if mp is not None and mp.buffer_dtype is not None:
        for module in root.owner.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    root.orig_buffer_dtypes[(id(module), name)] = buffer.dtype
                    module._buffers[name] = buffer.to(mp.buffer_dtype)


def unshard(state: FSDPState, prefetch: str | None = None, early: bool = False) -> None:
    """Start unsharding ``state``'s flat parameter (rate-limited; no-op if unsharded already).

    Args:
        prefetch: the prefetch direction, None if this is no prefetch.
        early: the issuing instance still holds its own buffer (the limiter's extra slot).
    """
    handle = state.handle
    if handle is None or not handle.copies or handle.is_unsharded:
        return
    context = state.context
    if state.limit_all_gathers and handle.sharded:
        counted = not state.is_root
        while (event := context.free_events.dequeue_if_needed(counted, early)) is not None:
            with torch.profiler.record_function(constants.RATE_LIMITER_RANGE):
                trace.emit(Op.RATE_LIMITER_WAIT, state.owner, event=event)
                event.synchronize()
    with state.device_handle.stream(context.unshard_stream):
        handle.issue_unshard(prefetch=prefetch)


def wait_unshard(state: FSDPState) -> None:
    device = state.device_handle
    state.handle.wait_unshard(device)
    device.current_stream().wait_stream(state.context.unshard_stream)


def reshard(state: FSDPState) -> None:
    """Free ``state``'s unsharded buffer and hand the free event to the limiter."""
    handle = state.handle
    if handle is None or not handle.copies or not handle.is_unsharded:
        return
    device = state.device_handle
    if handle.all_gather_work is not None:
        wait_unshard(state)
    if not handle.sharded:
        handle.free(device)
        return
    free_event = device.Event()
    trace.emit(Op.FREE, state.owner, event=free_event)
    handle.free(device)
    free_event.record()
    if state.limit_all_gathers:
        state.context.free_events.enqueue(free_event)


def prefetch(state: FSDPState, direction: str) -> None:
    """Issue the next instance's all-gather (no-op if it is unsharded or done this phase)."""
    order = state.context.exec_order
    forward = direction == "forward"
    target = (order.forward_prefetch_target if forward else order.backward_prefetch_target)(state)
    handle = None if target is None else target.handle
    if handle is None or not handle.copies or handle.is_unsharded:
        return
    if target.ran_forward if forward else (target.ran_post_backward or not handle.requires_grad):
        return  # done in this phase
    own = state.handle
    holds_own = own is not None and own.sharded and own.is_unsharded
    early = direction != "backward_post" and not state.is_root and holds_own
    trace.emit(Op.PREFETCH, state.owner, target=target.owner, direction=direction)
    unshard(target, prefetch=direction, early=early)


def root_pre_forward(state: FSDPState) -> None:
    """Lazy init; at an iteration's start, order the side streams after the optimizer step."""
    if state.is_root is None:
        lazy_init(state)
    if not state.is_root:
        return
    context = state.context
    for other in context.states:
        if other.training_state == TrainingState.SUMMON_FULL_PARAMS:
            raise RuntimeError(
                f"forward of {state.name()} called inside summon_full_params of "
                f"{other.name()}; exit the summon_full_params context before forward"
            )
    if state.training_state != TrainingState.IDLE:
        return  # a second forward before backward: same iteration
    context.exec_order.next_iter()
    for other in context.states:
        other.ran_forward = False
    current = state.device_handle.current_stream()
    context.unshard_stream.wait_stream(current)
    context.post_backward_stream.wait_stream(current)


def check_same_instance_on_all_ranks(state: FSDPState) -> None:
    """First iteration: one tiny all-gather checks every rank is in the same instance's
    pre-forward, so a mismatch raises on every rank instead of hanging."""
    context = state.context
    group = context.root.process_group
    if group.size() == 1:
        return
    index = torch.tensor([context.states.index(state)], dtype=torch.int64)
    gathered = [torch.empty_like(index) for _ in range(group.size())]
    dist.all_gather(gathered, index, group=group)
    indices = [int(t) for t in gathered]
    if len(set(indices)) > 1:
        running = ", ".join(
            f"rank {rank} runs {context.states[i].name()}" for rank, i in enumerate(indices)
        )
        raise RuntimeError(
            f"FSDP execution order differs across ranks in the first forward ({running}); "
            "every rank must run the same FSDP instances in the same order"
        )


def pre_forward(state: FSDPState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Unshard (and prefetch) before the wrapped module's forward."""
    state.recomputing = state.handle_training_state == HandleTrainingState.BACKWARD_PRE
    transition(state, TrainingState.FORWARD_BACKWARD, "pre-forward")
    if not state.recomputing:
        # a recompute stays in BACKWARD_PRE: non-reentrant checkpointing may stop it early,
        # before its post-forward runs
        transition(state, HandleTrainingState.FORWARD, "pre-forward")
    exec_order = state.context.exec_order
    if exec_order.is_first_iter and not state.recomputing:
        check_same_instance_on_all_ranks(state)
        exec_order.record_pre_forward(state)
    handle = state.handle
    if handle is None:
        return args, kwargs
    unshard(state)
    if state.forward_prefetch and not state.recomputing:
        prefetch(state, "forward")
    wait_unshard(state)
    handle.use_views(handle.unsharded)
    if handle.compute_dtype != handle.orig_dtype and handle.cast_forward_inputs:
        args, kwargs = _cast_floats((args, kwargs), handle.compute_dtype)
    return args, kwargs


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def post_forward(state: FSDPState, output: Any) -> Any:
    """Reshard (FULL_SHARD, non-root) and hook the outputs for pre-backward."""
    if state.recomputing:
        # a recompute inside backward keeps the parameters for the gradients that follow
        transition(state, HandleTrainingState.BACKWARD_PRE, "post-forward (recompute)")
        return output
    state.context.exec_order.record_post_forward(state)
    mp = state.mixed_precision
    if state.is_root and mp is not None and mp.output_dtype is not None:
        output = _cast_floats(output, mp.output_dtype)
    handle = state.handle
    if handle is not None and handle.strategy == ShardingStrategy.FULL_SHARD and not state.is_root:
        reshard(state)
    state.ran_forward = True
    transition(state, HandleTrainingState.IDLE, "post-forward")
    tensors = [t for t in output_tensors(output) if t.requires_grad]
    if torch.is_grad_enabled():
        for tensor in tensors:
            tensor.register_hook(functools.partial(pre_backward_hook, state))
    if state.is_root and (not tensors or not torch.is_grad_enabled()):
        finish_iteration(state)  # no backward will follow
    return output


def pre_backward_hook(state: FSDPState, grad: torch.Tensor) -> None:
    context = state.context
    if not context.callback_queued:
        context.callback_queued = True
        Variable._execution_engine.queue_callback(functools.partial(finish_iteration, context.root))
    if state.ran_pre_backward:
        return
    state.ran_pre_backward = True
    transition(state, HandleTrainingState.BACKWARD_PRE, "pre-backward hook")
    if state.handle is None:
        return
    unshard(state)
    if state.backward_prefetch == BackwardPrefetch.BACKWARD_PRE:
        prefetch(state, "backward_pre")
    wait_unshard(state)


def post_backward_hook(state: FSDPState, unsharded: torch.Tensor) -> None:
    transition(state, HandleTrainingState.BACKWARD_PRE, "post-backward hook")
    transition(state, HandleTrainingState.BACKWARD_POST, "post-backward hook")
    state.ran_post_backward = True
    handle = state.handle
    context = state.context
    device = state.device_handle
    reshard(state)
    if state.backward_prefetch == BackwardPrefetch.BACKWARD_POST:
        prefetch(state, "backward_post")
    if not state.sync_gradients:
        handle.accumulate_unsynced_grad()  # no_sync(): keep the unreduced gradient
        return
    context.post_backward_stream.wait_stream(device.current_stream())
    with device.stream(context.post_backward_stream):
        pending = handle.start_grad_reduction()
        if pending is not None:
            device.record_stream(pending.source, context.post_backward_stream)
    if pending is not None:
        context.pending_reductions.append((handle, pending))
    while len(context.pending_reductions) > 1:
        _finish_oldest_reduction(context, device)


def _finish_oldest_reduction(context: RootContext, device: Any) -> None:
    handle, pending = context.pending_reductions.popleft()
    current = device.current_stream()
    current.wait_stream(context.post_backward_stream)
    device.record_stream(pending.output, current)
    handle.finish_grad_reduction(pending)


def finish_iteration(root: FSDPState) -> None:
    """End of backward (or of a forward without backward): reshard all, back to IDLE."""
    context = root.context
    device = root.device_handle
    while context.pending_reductions:
        _finish_oldest_reduction(context, device)
    for state in context.states:
        reshard(state)
        state.handle_training_state = HandleTrainingState.IDLE
        if state.training_state == TrainingState.FORWARD_BACKWARD:
            transition(state, TrainingState.IDLE, "end of backward")
        state.ran_pre_backward = False
        state.ran_post_backward = False
    device.current_stream().wait_stream(context.post_backward_stream)
    context.callback_queued = False
    context.exec_order.end_first_iter()
