"""The one observer of collectives: each collective this process issues, handed to listeners.

[Note: collective observer]
Every collective an FSDP issues passes torch's dispatcher as an op of ``c10d`` (what
``torch.distributed.all_reduce`` and the other functions call) or of ``_c10d_functional`` (the
functional collectives of DTensor's ``redistribute`` and ``_functional_collectives``).
``install()`` registers one Python kernel per such op (every op of those namespaces whose name
starts with a collective's name: a release's missing or added names need no list) at the
``BackendSelect`` key. That key is in every dispatch (torch's default TLS set), below
autograd: the op's own autograd kernel runs first, so a functional collective's gradient is
torch's (a kernel at ``Autograd`` replaces it: measured on torch 2.13, ``funcol.all_reduce`` of
a tensor that requires grad then lost its ``grad_fn``), and inference-mode tensors, which skip
the autograd keys, are seen too. The kernel tells the listeners, then re-dispatches below
``BackendSelect``. No other op pays anything (a ``TorchDispatchMode`` sees every op: about 3x
a small model's training step); a collective about 28 us with a listener (torch 2.13, CPU).

- What each listener gets: a :class:`CollectiveCall` (the collective, torch's op name, the
  process group, the dtypes of the tensors handed to it, taken at the call: an FSDP may recast a
  tensor's ``.data`` after). It may return a function that is called once the
  collective ends (with the error if it failed): when the ``Work`` the op returns completes --
  ``dist.all_reduce`` returns after the op and blocks in ``Work.wait`` -- or, for an op with no
  ``Work`` of its own (a functional collective), when the ``Work`` of the c10d op it runs
  completes, else when it returns.
- Nesting: only the outermost collective of a thread is reported (a functional collective runs
  c10d's op; ThreadedProcessGroup's ``barrier`` is its ``allreduce``).
- Not seen: a process group written in Python (torch's ThreadedProcessGroup, the harness's
  thread mode) gets ``torch.distributed``'s calls as Python method calls, not through the
  dispatcher: ``observe_python_group(cls)`` routes its methods through the same listeners.
  Point-to-point ops (send, recv) are not collectives. Collectives a compiled graph issues pass
  the dispatcher too; tracing them (fake tensors) may be reported as calls.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from fsdp_conformance._patching import patch_attribute
from fsdp_conformance.constants import Op

# what a torch op or method name starts with (underscores stripped) -> the collective; a name
# before any that starts it ("reduce_scatter" before "reduce")
COLLECTIVE_NAMES = {
    **{op.value: op for op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER)},
    "allreduce": Op.ALL_REDUCE,
    "allgather": Op.ALL_GATHER,
    "alltoall": "all_to_all",
    **{name: name for name in "all_to_all barrier broadcast gather scatter reduce".split()},
    "monitored_barrier": "barrier",
}
NAMESPACES = ("c10d", "_c10d_functional")
_GROUP_ARGUMENTS = ("process_group", "group_name")  # how the ops' schemas name their group
_PATCH_KEY = "fsdp-conformance collective observer"

Done = Callable[[BaseException | None], None]


class CollectiveCall(NamedTuple):
    """One collective as it passes the dispatcher (or a Python process group's method)."""

    op: str  # the collective: an `Op` ("all_reduce", ...), "broadcast", "barrier", ...
    name: str  # torch's: "c10d.allreduce_", "_c10d_functional.reduce_scatter_tensor", ...
    group: Any  # the torch.distributed ProcessGroup (None where it could not be resolved)
    dtypes: tuple[Any, ...]  # of every tensor handed to it, in argument order


Listener = Callable[[CollectiveCall], Done | None]

_lock = threading.Lock()
_listeners: tuple[Listener, ...] = ()
_libraries: list[Any] = []  # the torch.library registrations, kept alive
# .futures: while this thread runs an observed collective, the futures of the Works inside it
_local = threading.local()


def collective_of(name: str) -> str | None:
    """The collective a torch op or method name performs (None: not a collective)."""
    stripped = name.strip("_")
    return next((op for start, op in COLLECTIVE_NAMES.items() if stripped.startswith(start)), None)


def install() -> None:
    """Register the observing kernels (once per process; a second call does nothing)."""
    import torch
    from torch._library.utils import lookup_op

    with _lock:
        if _libraries:
            return
        after = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
        libraries = {space: torch.library.Library(space, "IMPL") for space in NAMESPACES}
        _libraries.extend(libraries.values())
        for qualified in torch._C._dispatch_get_all_op_names():
            namespace, _, name = qualified.partition("::")
            op = collective_of(name.partition(".")[0])
            if namespace in libraries and op is not None:
                kernel = _kernel(lookup_op(qualified), op, after)
                libraries[namespace].impl(name, kernel, "BackendSelect", with_keyset=True)


def observe_python_group(group_class: type) -> None:
    """Route the collective methods ``group_class`` (a ``ProcessGroup`` written in Python)
    defines through the listeners (once per class and method)."""
    for name, method in list(vars(group_class).items()):
        op = collective_of(name)
        if op is not None and callable(method) and not name.startswith("__"):

            def make(original: Callable[..., Any], op: str = op, name: str = name) -> Any:
                @functools.wraps(original)
                def observed(group: Any, *args: Any, **kwargs: Any) -> Any:
                    dtypes = _dtypes((args, kwargs))
                    call = CollectiveCall(op, f"{group_class.__name__}.{name}", group, dtypes)
                    return _observed(call, lambda: original(group, *args, **kwargs))

                return observed

            patch_attribute(group_class, name, make, key=_PATCH_KEY, written_for="torch 2.13.0")


def listeners() -> tuple[Listener, ...]:
    """The listeners registered now (the harness puts them back after each test)."""
    return _listeners


def set_listeners(kept: tuple[Listener, ...]) -> None:
    """Make ``kept`` (from :func:`listeners`) the registered listeners again."""
    global _listeners
    with _lock:
        _listeners = kept


def add_listener(listener: Listener) -> Callable[[], None]:
    """``listener`` gets every collective call of this process (``install()`` first) until the
    returned function removes it."""
    global _listeners
    install()
    with _lock:
        _listeners = (*_listeners, listener)

    def remove() -> None:
        global _listeners
        with _lock:
            _listeners = tuple(other for other in _listeners if other is not listener)

    return remove


def _kernel(overload: Any, op: str, after: Any) -> Callable[..., Any]:
    arguments = [argument.name for argument in overload._schema.arguments]
    index = next((arguments.index(a) for a in _GROUP_ARGUMENTS if a in arguments), None)
    name = str(overload).rsplit(".", 1)[0]

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        redispatch = functools.partial(overload.redispatch, keyset & after, *args, **kwargs)
        if not _listeners and getattr(_local, "futures", None) is None:
            return redispatch()
        group = _process_group(args[index] if index is not None and index < len(args) else None)
        return _observed(CollectiveCall(op, name, group, _dtypes((args, kwargs))), redispatch)

    return kernel


def _observed(call: CollectiveCall, run: Callable[[], Any]) -> Any:
    """``run()`` the collective ``call``, telling the listeners (only the outermost of a
    thread's nested collectives; a nested one's Work tells when the outer one ends)."""
    import torch

    if (nested := getattr(_local, "futures", None)) is not None:
        result = run()
        nested += _futures(result)
        return result
    dones = [done for listener in _listeners if (done := listener(call)) is not None]
    _local.futures = nested = []
    try:
        result = run()
    except BaseException as error:
        _finish(dones, error)
        raise
    finally:
        _local.futures = None
    if not (futures := _futures(result) or nested):
        _finish(dones, None)
    elif dones:
        ended = torch.futures.collect_all(futures)
        ended.add_done_callback(lambda _: _finish(dones, _error(futures)))
    return result


def _finish(dones: list[Done], error: BaseException | None) -> None:
    for done in dones:
        done(error)


def _futures(result: Any) -> list[Any]:
    """The future of the ``Work`` a collective op or method returned, if it has one."""
    import torch
    from torch.distributed.distributed_c10d import Work

    work = result[-1] if isinstance(result, (tuple, list)) and result else result
    if isinstance(work, torch.ScriptObject):
        work = Work.unbox(work)
    try:
        return [work.get_future()] if isinstance(work, Work) else []
    except RuntimeError:  # a backend without futures: ended when the op returned
        return []


def _error(futures: list[Any]) -> BaseException | None:
    for future in futures:
        try:
            future.wait()
        except Exception as error:  # noqa: BLE001  the collective failed: told, not raised here
            return error
    return None


def _process_group(group: Any) -> Any:
    """The ProcessGroup an op's group argument names (a boxed group or a group name)."""
    import torch
    import torch.distributed as dist

    resolve = dist.distributed_c10d._resolve_process_group
    try:
        if isinstance(group, torch.ScriptObject):
            return dist.ProcessGroup.unbox(group)
        return resolve(group) if isinstance(group, str) else group
    except (RuntimeError, ValueError):
        return None


def _dtypes(value: Any) -> tuple[Any, ...]:
    """The dtypes of the tensors in ``value`` (nested lists, tuples and dicts). A plain walk: it
    runs on every collective of every rank, and torch's pytree walk was a third of the
    observer's own cost."""
    import torch

    if isinstance(value, torch.Tensor):
        return (value.dtype,)
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return ()
    return tuple(dtype for item in value for dtype in _dtypes(item))
