"""The lagging device inside torch FSDP2, and its buffers' lifetimes per stream.

Every FSDP2 internal used here goes through `_fsdp2_internals` (verified on the releases it
names); if a torch release moved one, `install_lagging_device` and `observe_buffers` raise its
`FSDP2InternalsError` naming the missing attribute.

[Note: FSDP2's device handle]
FSDP2 takes its device handle from `torch.distributed.device_mesh._get_device_handle` in three
places that keep it: `FSDPState._device_handle` (set in `FSDPState.init`, at `fully_shard`),
`FSDPParamGroup.device_handle` (set in its constructor) and `FSDPCommContext.device_handle`
(set, with the four streams -- all-gather copy-in, all-gather, reduce-scatter, all-reduce -- in
`FSDPCommContext.lazy_init`, which the root calls at its lazy init, i.e. the first forward).
`_fsdp_collectives` looks the handle up on each call but only to enter `stream(s)` on the
streams FSDP2 passes in and to read the current stream; on CPU that is `torch.cpu.stream`,
which accepts any stream object. So the device is installed per model, after wrapping and
before the first forward, by replacing the first two attributes and by giving each state's comm
context an instance-level `lazy_init` that runs FSDP2's own and then points the context's handle
and streams at the lagging device. Nothing process-wide changes; the model is the only owner.

[Note: FSDP2 buffers]
Per unshard FSDP2 holds two buffers of one instance's unsharded size each:
- the all-gather output, allocated on the all-gather copy-in stream (the separate streams of
  implicit prefetching) or on the current stream (`async_op` / explicit prefetch outside
  forward and pre-backward), written by the all-gather stream and read by the copy-out on the
  current stream; its lifetime is that of the tensor (observed with `weakref.finalize`, so a
  reference kept anywhere keeps it resident);
- the unsharded parameters, allocated by the copy-out on the current stream and freed there
  (`FSDPParamGroup._to_unsharded` / `_to_sharded` / `_to_sharded_post_forward`: the state
  transitions, not the config that asks for them).
`observe_buffers` reports them to a residency observer as "all_gather" (the all-gather output,
once allocated), "alloc" (the unsharded parameters) and "free", with `info` = {"buffer": kind,
"stream": the allocating stream, "used_after": the device's last recorded event when another
stream last used the buffer, or None} -- the stream-ordered reuse rule of
`fsdp_conformance.observe.residency` decides from these when the block is reusable.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from fsdp_conformance._patching import patch_attribute
from fsdp_conformance.constants import Op

from . import _fsdp2_internals as internals
from .base import require_before_first_forward

# the key of this module's patches (fsdp_conformance._patching)
_PATCH_KEY = "fsdp-conformance torch-fsdp2 buffer lifetimes"
_WRITTEN_FOR = "torch " + "/".join(internals.VERIFIED_ON)

# Buffer observers: emit(op, group, info) -> every registered callback(op, group, info)
_buffer_observers: list[Callable[[str, Any, dict], None]] = []
_lock = threading.Lock()  # guards the observer list and the pending records


def install_lagging_device(model: nn.Module, device: Any) -> None:
    """Make every FSDP2 instance in ``model`` use ``device`` as its device handle.

    Args:
        model: an FSDP2-wrapped model (``fully_shard``), before its first forward.
        device: a ``fsdp_conformance.observe.LaggingDevice``.

    Raises:
        RuntimeError: the model already ran forward (FSDP2 created its streams at lazy init).
        FSDP2InternalsError: FSDP2's internals are none of the shapes ``_fsdp2_internals`` knows.
    """
    from torch.distributed.fsdp import FSDPModule

    states = [
        internals.fsdp_state(module) for module in model.modules() if isinstance(module, FSDPModule)
    ]
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
            # a lagging device hands out streams that remember what they waited for (the
            # stream-ordered residency rule reads them); any other handle, its own streams
            ordered = getattr(device, "ordered_stream", None)
            setattr(context, name, ordered(name) if callable(ordered) else device.Stream())

    context.lazy_init = lazy_init  # this context object only


def current_stream_of(group: Any) -> Any:
    """The stream ``group`` runs on now (its device handle's current stream)."""
    internals.require(group, "device_handle")
    return group.device_handle.current_stream()


def _device_of(group: Any) -> Any:
    device = group.device_handle
    return device if hasattr(device, "recorded") else None


def _emit(op: str, group: Any, info: dict) -> None:
    for observer in _buffer_observers.copy():
        observer(op, group, info)


def _patch_buffer_lifetimes() -> None:
    """Report FSDP2's buffers (see [Note: FSDP2 buffers]); once per process, pass-through idle."""
    group_class = internals.param_group_class()
    internals.require(
        group_class, "_to_unsharded", "_to_sharded", "_to_sharded_post_forward", "is_unsharded"
    )

    def unshard(original):
        def patched_unshard(self, async_op: bool = False):
            if not _buffer_observers:
                return original(self, async_op)
            before = internals.all_gather_result(self)
            result = original(self, async_op)
            after = internals.all_gather_result(self)
            if (
                after is not None
                and after is not before
                and internals.all_gather_group_size(self) > 1
            ):
                stream = internals.all_gather_copy_in_stream(self, async_op)
                internals.set_all_gather_result(self, _track_all_gather_output(self, after, stream))
            return result

        return patched_unshard

    def to_unsharded(original):
        def patched_to_unsharded(self):
            was_unsharded = self.is_unsharded
            result = original(self)
            if _buffer_observers and not was_unsharded and self.is_unsharded:
                device = _device_of(self)
                for record in _READERS.get(self, ()):
                    if record["used_after"] is None and device is not None:
                        # the copy-out (on the current stream) was the buffer's last foreign use
                        record["used_after"] = device.recorded
                _emit(Op.ALLOC, self, {"buffer": "unsharded", "stream": current_stream_of(self)})
            return result

        return patched_to_unsharded

    def freeing(original):
        def patched(self):
            was_unsharded = self.is_unsharded
            result = original(self)
            if _buffer_observers and was_unsharded and not self.is_unsharded:
                stream = current_stream_of(self)
                _emit(Op.FREE, self, {"buffer": "unsharded", "stream": stream, "used_after": None})
            return result

        return patched

    for attribute, make in (
        ("unshard", unshard),
        ("_to_unsharded", to_unsharded),
        ("_to_sharded", freeing),
        ("_to_sharded_post_forward", freeing),
    ):
        patch_attribute(group_class, attribute, make, key=_PATCH_KEY, written_for=_WRITTEN_FOR)


# group -> records of its all-gather outputs not yet copied out (weak: groups die with models)
_READERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# AllGatherResult class -> its tracked subclass
_TRACKED_CLASSES: dict[type, type] = {}


class _ReleaseToken:
    """Lives exactly as long as the tracked ``AllGatherResult`` holding it (weakly referenced)."""

    __slots__ = ("__weakref__",)


def _tracked_class(result_class: type) -> type:
    """A subclass of FSDP2's ``AllGatherResult`` (a NamedTuple) whose instances have a
    ``__dict__`` to carry a ``_ReleaseToken``: equal, unpackable, ``isinstance`` the original."""
    tracked = _TRACKED_CLASSES.get(result_class)
    if tracked is None:
        tracked = type(f"Tracked{result_class.__name__}", (result_class,), {})
        _TRACKED_CLASSES[result_class] = tracked
    return tracked


def _track_all_gather_output(group: Any, result: Any, stream: Any) -> Any:
    """Report the all-gather output allocated; return the result to store in its place, whose
    release (the last reference to it dropped, wherever held) reports the output free."""
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
    """The tracked result was released: report its all-gather output free."""
    owner = group_ref()
    if owner is None or record["released"]:
        return
    record["released"] = True
    records = _READERS.get(owner, [])
    if record in records:
        records.remove(record)
    info = {"buffer": "all_gather_output", "stream": record["stream"]}
    _emit(Op.FREE, owner, {**info, "used_after": record["used_after"]})


@contextlib.contextmanager
def observe_buffers(callback: Callable[[str, Any, dict], None]) -> Iterator[None]:
    """Context manager: ``callback(op, group, info)`` hears FSDP2's buffer events.

    Args:
        callback: called as [Note: FSDP2 buffers] says, with the ``FSDPParamGroup``.
    """
    _patch_buffer_lifetimes()
    with _lock:
        _buffer_observers.append(callback)
    try:
        yield
    finally:
        with _lock:
            _buffer_observers.remove(callback)
