"""The lagging device inside torch FSDP2, and its buffers' lifetimes per stream (torch 2.13.0).

Written against torch 2.13.0 (`torch/distributed/fsdp/_fully_shard/`). Everything this module
relies on is checked where it is used; if a torch release moved it, `install_lagging_device`
and `observe_buffers` raise `RuntimeError` naming the missing attribute and this file.

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
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from fsdp_conformance.vocab import Op

from .base import require_before_first_forward

# The torch version the patch below was written against
WRITTEN_AGAINST = "2.13.0"
# FSDPCommContext's streams, replaced by lagging-device streams at lazy init
_COMM_STREAMS = (
    "all_gather_copy_in_stream",
    "all_gather_stream",
    "reduce_scatter_stream",
    "all_reduce_stream",
)

# Buffer observers: emit(op, group, info) -> every registered callback(op, group, info)
_buffer_observers: list[Callable[[str, Any, dict], None]] = []
_lock = threading.Lock()  # guards the one-time patch
_patched = False


def _moved(what: str) -> RuntimeError:
    import torch

    return RuntimeError(
        f"torch FSDP2 internals moved: {what} (fsdp_conformance/adapters/_fsdp2_device.py was "
        f"written against torch {WRITTEN_AGAINST}, this is torch {torch.__version__}); update "
        "the patch there"
    )


def _require(obj: Any, *names: str) -> None:
    for name in names:
        if not hasattr(obj, name):
            raise _moved(f"{type(obj).__name__}.{name} is missing")


def install_lagging_device(model: nn.Module, device: Any) -> None:
    """Make every FSDP2 instance in ``model`` use ``device`` as its device handle.

    Args:
        model: an FSDP2-wrapped model (``fully_shard``), before its first forward.
        device: a ``fsdp_conformance.observe.LaggingDevice``.

    Raises:
        RuntimeError: the model already ran forward (FSDP2 created its streams at lazy init),
            or FSDP2's internals are not those of torch 2.13.0.
    """
    from torch.distributed.fsdp import FSDPModule

    states = [
        module._get_fsdp_state() for module in model.modules() if isinstance(module, FSDPModule)
    ]
    for state in states:
        _require(state, "_device_handle", "_fsdp_param_groups", "_comm_ctx", "_is_root")
    require_before_first_forward("torch-fsdp2", model, states)
    for state in states:
        state._device_handle = device
        for group in state._fsdp_param_groups:
            _require(group, "device_handle")
            group.device_handle = device
        _install_comm_context(state._comm_ctx, device)


def _install_comm_context(context: Any, device: Any) -> None:
    _require(type(context), "lazy_init")
    own_lazy_init = type(context).lazy_init

    def lazy_init(torch_device: Any) -> None:
        own_lazy_init(context, torch_device)
        _require(context, "device_handle", *_COMM_STREAMS)
        context.device_handle = device
        for name in _COMM_STREAMS:
            # a lagging device hands out streams that remember what they waited for (the
            # stream-ordered residency rule reads them); any other handle, its own streams
            ordered = getattr(device, "ordered_stream", None)
            setattr(context, name, ordered(name) if callable(ordered) else device.Stream())

    context.lazy_init = lazy_init  # this context object only


def current_stream_of(group: Any) -> Any:
    """The stream ``group`` runs on now (its device handle's current stream)."""
    return group.device_handle.current_stream()


def _device_of(group: Any) -> Any:
    device = group.device_handle
    return device if hasattr(device, "recorded") else None


def _emit(op: str, group: Any, info: dict) -> None:
    _sweep_released()
    for observer in _buffer_observers.copy():
        observer(op, group, info)


def _patch_buffer_lifetimes() -> None:
    """Report FSDP2's buffers (see [Note: FSDP2 buffers]); once per process, pass-through idle."""
    global _patched
    with _lock:
        if _patched:
            return
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        _require(
            FSDPParamGroup,
            "unshard",
            "_to_unsharded",
            "_to_sharded",
            "_to_sharded_post_forward",
            "is_unsharded",
        )
        unshard = FSDPParamGroup.unshard
        to_unsharded = FSDPParamGroup._to_unsharded
        to_sharded = FSDPParamGroup._to_sharded
        to_sharded_post_forward = FSDPParamGroup._to_sharded_post_forward

        def patched_unshard(self, async_op: bool = False):
            if not _buffer_observers:
                return unshard(self, async_op)
            before = self._all_gather_result
            result = unshard(self, async_op)
            after = self._all_gather_result
            if (
                after is not None
                and after is not before
                and self._all_gather_process_group.size() > 1
            ):
                copy_in_stream, _ = self.comm_ctx.get_all_gather_streams(
                    async_op, self._training_state
                )
                _track_all_gather_output(self, after, copy_in_stream)
            return result

        def patched_to_unsharded(self):
            was_unsharded = self.is_unsharded
            result = to_unsharded(self)
            if _buffer_observers and not was_unsharded and self.is_unsharded:
                device = _device_of(self)
                for record in _READERS.get(self, ()):
                    if record["used_after"] is None and device is not None:
                        # the copy-out (on the current stream) was the buffer's last foreign use
                        record["used_after"] = device.recorded
                _emit(Op.ALLOC, self, {"buffer": "unsharded", "stream": current_stream_of(self)})
            return result

        def freeing(original):
            def patched(self):
                was_unsharded = self.is_unsharded
                result = original(self)
                if _buffer_observers and was_unsharded and not self.is_unsharded:
                    stream = current_stream_of(self)
                    _emit(
                        Op.FREE, self, {"buffer": "unsharded", "stream": stream, "used_after": None}
                    )
                return result

            return patched

        FSDPParamGroup.unshard = patched_unshard
        FSDPParamGroup._to_unsharded = patched_to_unsharded
        FSDPParamGroup._to_sharded = freeing(to_sharded)
        FSDPParamGroup._to_sharded_post_forward = freeing(to_sharded_post_forward)
        _patched = True


# group -> records of its all-gather outputs not yet copied out (weak: groups die with models)
_READERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# records of all-gather outputs not yet reported free
_PENDING: list[dict[str, Any]] = []
# references to an object only ``_PENDING`` holds: its record's + getrefcount's argument
_UNREFERENCED = 2


def _track_all_gather_output(group: Any, result: Any, stream: Any) -> None:
    record: dict[str, Any] = {
        "used_after": None,
        "stream": stream,
        "group": weakref.ref(group),
        "result": result,
    }
    _READERS.setdefault(group, []).append(record)
    _emit(Op.ALL_GATHER, group, {"buffer": "all_gather_output", "stream": stream})
    _PENDING.append(record)


def _sweep_released() -> None:
    """Report free the all-gather outputs whose result nothing but this module holds any more.

    The output lives as long as FSDP2's ``AllGatherResult`` (or anything else in Python that
    keeps it: a variant that stores results, a local variable). The tensor itself is not
    watched: on gloo the collective's work object also holds it and drops it on gloo's worker
    thread a moment after FSDP2 does, at no fixed point of this thread.
    """
    for record in _PENDING.copy():
        if sys.getrefcount(record["result"]) > _UNREFERENCED:
            continue
        _PENDING.remove(record)
        record["result"] = None
        owner = record["group"]()
        if owner is None:
            continue
        records = _READERS.get(owner, [])
        if record in records:
            records.remove(record)
        info = {"buffer": "all_gather_output", "stream": record["stream"]}
        for observer in _buffer_observers.copy():
            observer(Op.FREE, owner, {**info, "used_after": record["used_after"]})


@contextlib.contextmanager
def observe_buffers(callback: Callable[[str, Any, dict], None]) -> Iterator[None]:
    """Context manager: ``callback(op, group, info)`` hears FSDP2's buffer events.

    Args:
        callback: called as [Note: FSDP2 buffers] says, with the ``FSDPParamGroup``.
    """
    _patch_buffer_lifetimes()
    _buffer_observers.append(callback)
    try:
        yield
    finally:
        _buffer_observers.remove(callback)
        if not _buffer_observers:
            _PENDING.clear()  # nobody listens: drop the results held for the sweep
