"""Route fairscale FSDP's CUDA stream and event calls through a device handle (fairscale 0.4.13).

fairscale's ``FullyShardedDataParallel`` calls the CUDA API directly (``torch.cuda.Stream``,
``stream``, ``current_stream``, ``synchronize``, ``Tensor.record_stream``; on a host without
CUDA the first forward fails with ``KeyError: 'all_gather'``). ``route(instance, handle)`` gives
one instance its own versions of the methods making those calls (``ROUTED_METHODS``); while one
runs, that thread's calls go to the handle through a ``torch`` proxy in fairscale's module and a
routed ``Tensor.record_stream``, installed while any routed call is open and restored after the
last, so other threads and other instances see the real CUDA API. Tensors, collectives and
arithmetic are untouched.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from fsdp_conformance._patching import patch_attribute

_PATCH_KEY = "fsdp-conformance fairscale device routing"
FAIRSCALE_VERSION = "0.4.13"
# methods of fairscale's FullyShardedDataParallel that call the CUDA API
ROUTED_METHODS = (
    "_setup_streams",
    "_wait_for_previous_optim_step",
    "_rebuild_full_params",
    "_cast_fp32_param_shards_to_fp16",
    "_free_fp16_param_shard",
    "_free_full_params",
    "_post_backward_hook",
    "_post_reduction_hook",
    "_wait_for_post_backward",
)
# routed for as long as their context is open
ROUTED_CONTEXTS = ("summon_full_params",)
# the CUDA API names taken from the handle while routed
_HANDLE_NAMES = frozenset(
    {"is_available", "Stream", "Event", "stream", "current_stream", "synchronize"}
)
_HANDLE_ATTR = "_fsdp_conformance_device"

_local = threading.local()  # .handles: the handles of the routed calls open on this thread
_lock = threading.Lock()
_depth = 0  # routed calls open on all threads
_saved: dict[str, Any] = {}  # the originals replaced while _depth > 0


def _current_handle() -> Any:
    handles = getattr(_local, "handles", None)
    return handles[-1] if handles else None


class _CudaRouter:
    """``torch.cuda`` while routed: the thread's handle, else the real one."""

    def __getattr__(self, name: str) -> Any:
        handle = _current_handle()
        if handle is not None and name in _HANDLE_NAMES:
            return getattr(handle, name)
        return getattr(torch.cuda, name)


class _TorchProxy:
    """The ``torch`` module with ``cuda`` replaced by ``_CudaRouter``."""

    cuda = _CudaRouter()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_TORCH_PROXY = _TorchProxy()
# torch's own Tensor.record_stream (inherited from the C base class in torch 2.13.0)
_ORIGINAL_RECORD_STREAM = torch.Tensor.record_stream


def _record_stream(tensor: torch.Tensor, stream: Any) -> None:
    handle = _current_handle()
    if handle is not None and not isinstance(stream, torch.Stream):
        handle.record_stream(tensor, stream)
        return
    _ORIGINAL_RECORD_STREAM(tensor, stream)


def _fsdp_module() -> Any:
    from fairscale.nn.data_parallel import fully_sharded_data_parallel

    return fully_sharded_data_parallel


def check_internals() -> None:
    """RuntimeError, naming the versions and what is missing, unless fairscale has the
    internals this module routes."""
    import fairscale

    module = _fsdp_module()
    fsdp = module.FullyShardedDataParallel
    missing = [name for name in ROUTED_METHODS + ROUTED_CONTEXTS if not hasattr(fsdp, name)]
    if not any(getattr(module, "torch", None) is known for known in (torch, _TORCH_PROXY)):
        missing.append("the module global 'torch' of fairscale.nn.data_parallel")
    if missing:
        raise RuntimeError(
            f"fairscale {getattr(fairscale, '__version__', '?')}: FullyShardedDataParallel "
            f"internals moved ({', '.join(missing)} not found); the fairscale adapter routes "
            f"CUDA calls as of fairscale {FAIRSCALE_VERSION}: install "
            f"fairscale=={FAIRSCALE_VERSION} or update fsdp_conformance/adapters/"
            "_fairscale_device.py"
        )


@contextlib.contextmanager
def _routing(handle: Any) -> Iterator[None]:
    global _depth
    with _lock:
        if _depth == 0:
            # on torch.Tensor itself, or inherited from the C base class (torch 2.13.0)
            _saved["own_record_stream"] = "record_stream" in vars(torch.Tensor)
            patch = functools.partial(
                patch_attribute, key=_PATCH_KEY, written_for=f"fairscale {FAIRSCALE_VERSION}"
            )
            _saved["records"] = [
                patch(_fsdp_module(), "torch", lambda original: _TORCH_PROXY, library="fairscale"),
                patch(torch.Tensor, "record_stream", lambda original: _record_stream),
            ]
        _depth += 1
    handles = _local.__dict__.setdefault("handles", [])
    handles.append(handle)
    try:
        yield
    finally:
        handles.pop()
        with _lock:
            _depth -= 1
            if _depth == 0:
                for record in reversed(_saved.pop("records")):
                    record.undo()
                if not _saved.pop("own_record_stream") and "record_stream" in vars(torch.Tensor):
                    del torch.Tensor.record_stream  # inherited again, exactly as imported


def _routed_method(instance: nn.Module, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def routed(*args: Any, **kwargs: Any) -> Any:
        with _routing(instance.__dict__[_HANDLE_ATTR]):
            return method(*args, **kwargs)

    return routed


def _routed_context(instance: nn.Module, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    @contextlib.contextmanager
    def routed(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with _routing(instance.__dict__[_HANDLE_ATTR]), method(*args, **kwargs) as value:
            yield value

    return routed


def route(instance: nn.Module, handle: Any, wrappers: dict[str, Callable] | None = None) -> None:
    """Send a fairscale instance's CUDA calls to `handle` (re-routing replaces the handle);
    `wrappers`: ``{method name: f(original) -> replacement}`` applied inside the routing."""
    already = _HANDLE_ATTR in instance.__dict__
    instance.__dict__[_HANDLE_ATTR] = handle
    if already:
        return
    cls = type(instance)
    for name in ROUTED_METHODS:
        method = getattr(cls, name).__get__(instance, cls)
        if wrappers and name in wrappers:
            method = wrappers[name](method)
        instance.__dict__[name] = _routed_method(instance, method)
    for name in ROUTED_CONTEXTS:
        instance.__dict__[name] = _routed_context(instance, getattr(cls, name).__get__(instance))


def handle_of(instance: nn.Module) -> Any:
    return instance.__dict__.get(_HANDLE_ATTR)
