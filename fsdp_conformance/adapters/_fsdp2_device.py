"""The lagging device inside torch FSDP2, and its buffers' lifetimes per stream (every FSDP2
internal through `_fsdp2_internals`, which names one that moved).

[Note: FSDP2's device handle]
FSDP2 keeps its device handle in `FSDPState._device_handle`, `FSDPParamGroup.device_handle`
and `FSDPCommContext.device_handle` (set with its four streams at the root's lazy init, the
first forward); `_fsdp_collectives` only enters the streams it is given. So the device is
installed per model, before the first forward: the first two are replaced, and each comm
context gets an instance-level `lazy_init` that runs FSDP2's own and then points its handle and
streams at the device. Nothing process-wide changes.

[Note: FSDP2 buffers]
Per unshard FSDP2 holds two buffers of one instance's unsharded size: the all-gather output
(allocated on the copy-in stream or, for `async_op` / explicit prefetch, the current one; alive
as long as its tensor, observed with `weakref.finalize`) and the unsharded parameters (the
copy-out on the current stream, `_to_unsharded` / `_to_sharded(_post_forward)`).
`observe_buffers` reports them as "all_gather", "alloc" and "free" with `info` = {"buffer",
"stream": the allocating stream, "used_after": the device's last recorded event when another
stream last used it, or None}, for the stream-ordered rule of `observe.residency`.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from torch import nn

from fsdp_conformance.constants import Op

from . import _fsdp2_internals as internals
from .base import ObserverRegistry, require_before_first_forward

# process-wide: observers of the buffer events, and param group -> its module (the instance)
_BUFFERS = ObserverRegistry(
    "fsdp-conformance torch-fsdp2 buffer lifetimes", "torch " + "/".join(internals.VERIFIED_ON)
)
INSTANCE_OF_GROUP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def install_lagging_device(model: nn.Module, device: Any) -> None:
    """Make every FSDP2 instance in ``model`` use ``device`` ([Note: FSDP2's device handle]);
    RuntimeError when it already ran forward."""
    from torch.distributed.fsdp import FSDPModule

    states = [internals.fsdp_state(m) for m in model.modules() if isinstance(m, FSDPModule)]
    contexts = [internals.comm_context(state) for state in states]
    require_before_first_forward("torch-fsdp2", model, states)
    for state, context in zip(states, contexts):
        internals.set_device_handle(state, device)
        _install_comm_context(context, device)


def _install_comm_context(context: Any, device: Any) -> None:
    internals.require(type(context), "lazy_init")
    own_lazy_init = type(context).lazy_init

    def lazy_init(torch_device: Any) -> None:
        own_lazy_init(context, torch_device)
        internals.require(context, "device_handle", *internals.COMM_STREAMS)
        context.device_handle = device
        for name in internals.COMM_STREAMS:
            # a lagging device's streams remember what they waited for (the residency rule)
            ordered = getattr(device, "ordered_stream", None)
            setattr(context, name, ordered(name) if callable(ordered) else device.Stream())

    context.lazy_init = lazy_init  # this context object only


def current_stream_of(group: Any) -> Any:
    internals.require(group, "device_handle")
    return group.device_handle.current_stream()


def _device_of(group: Any) -> Any:
    device = group.device_handle
    return device if hasattr(device, "recorded") else None


def _emit(op: str, group: Any, info: dict) -> None:
    _BUFFERS.emit(op, INSTANCE_OF_GROUP.get(group), info)


def _patch_buffer_lifetimes() -> None:
    """Report FSDP2's buffers ([Note: FSDP2 buffers]); once per process, pass-through idle."""
    group_class = internals.param_group_class()
    internals.require(
        group_class, "_to_unsharded", "_to_sharded", "_to_sharded_post_forward", "is_unsharded"
    )

    def unshard(original):
        def patched_unshard(self, async_op: bool = False):
            if not _BUFFERS.active:
                return original(self, async_op)
            before = internals.all_gather_result(self)
            result = original(self, async_op)
            after = internals.all_gather_result(self)
            issued = after is not None and after is not before
            if issued and internals.all_gather_group_size(self) > 1:
                stream = internals.all_gather_copy_in_stream(self, async_op)
                internals.set_all_gather_result(self, _track_all_gather_output(self, after, stream))
            return result

        return patched_unshard

    def to_unsharded(original):
        def patched_to_unsharded(self):
            was_unsharded = self.is_unsharded
            result = original(self)
            if _BUFFERS.active and not was_unsharded and self.is_unsharded:
                device = _device_of(self)
                for record in _READERS.get(self, ()):
                    if record["used_after"] is None and device is not None:
                        # the copy-out was the buffer's last use by another stream
                        record["used_after"] = device.recorded
                _emit(Op.ALLOC, self, {"buffer": "unsharded", "stream": current_stream_of(self)})
            return result

        return patched_to_unsharded

    def freeing(original):
        def patched(self):
            was_unsharded = self.is_unsharded
            result = original(self)
            if _BUFFERS.active and was_unsharded and not self.is_unsharded:
                stream = current_stream_of(self)
                _emit(Op.FREE, self, {"buffer": "unsharded", "stream": stream, "used_after": None})
            return result

        return patched

    _BUFFERS.patch(group_class, "unshard", unshard)
    _BUFFERS.patch(group_class, "_to_unsharded", to_unsharded)
    _BUFFERS.patch(group_class, "_to_sharded", freeing)
    _BUFFERS.patch(group_class, "_to_sharded_post_forward", freeing)


# group -> records of its all-gather outputs not yet copied out
_READERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _ReleaseToken:
    """Lives exactly as long as the tracked ``AllGatherResult`` holding it."""

    __slots__ = ("__weakref__",)


@functools.cache
def _tracked_class(result_class: type) -> type:
    """A subclass of FSDP2's ``AllGatherResult`` (a NamedTuple) with a ``__dict__`` for the
    token: equal, unpackable, ``isinstance`` the original (one per result class)."""
    return type(f"Tracked{result_class.__name__}", (result_class,), {})


def _track_all_gather_output(group: Any, result: Any, stream: Any) -> Any:
    """Report the all-gather output allocated; the result to store instead, whose release
    reports it free."""
    record: dict[str, Any] = {"used_after": None, "stream": stream, "released": False}
    _READERS.setdefault(group, []).append(record)
    _emit(Op.ALL_GATHER, group, {"buffer": "all_gather_output", "stream": stream})
    if not isinstance(result, tuple) or not hasattr(result, "_fields"):
        raise internals.moved(f"AllGatherResult is no NamedTuple ({type(result).__name__})")
    tracked = _tracked_class(type(result))(*result)
    token = _ReleaseToken()
    tracked.__dict__["_fsdp_conformance_release"] = token
    finalizer = weakref.finalize(token, _released, weakref.ref(group), record)
    finalizer.atexit = False
    return tracked


def _released(group_ref: Any, record: dict[str, Any]) -> None:
    owner = group_ref()
    if owner is None or record["released"]:
        return
    record["released"] = True
    records = _READERS.get(owner, [])
    if record in records:
        records.remove(record)
    info = {"buffer": "all_gather_output", "stream": record["stream"]}
    _emit(Op.FREE, owner, {**info, "used_after": record["used_after"]})


def observe_buffers(callback: Any, instances: list[nn.Module] | None) -> Any:
    """`Adapter._observe` of FSDP2's buffer events ([Note: FSDP2 buffers]; [Note: observation]
    in adapters/base.py)."""
    _patch_buffer_lifetimes()
    return _BUFFERS.observing(callback, instances)
