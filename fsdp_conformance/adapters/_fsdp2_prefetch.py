"""The suite's prefetch settings in torch FSDP2's terms: explicit lists from the recorded order.

[Note: FSDP2 prefetch mapping]
FSDP2 prefetches the modules of ``set_modules_to_forward_prefetch`` in forward (none by
default) and, at each pre-backward, those of ``set_modules_to_backward_prefetch`` or, when that
is empty, the instance before it in the post-forward order (implicit). So:

- ``forward_prefetch=True``: as FSDP1, the first forward's order is recorded and from the
  second forward on each instance prefetches the next one;
- ``BACKWARD_PRE`` (or the key not given): the implicit prefetch;
- ``BACKWARD_POST``: no such point in FSDP2; the same one-ahead target as an explicit list
  (the instance before it in the first iteration's post-forward order), issued at pre-backward;
- ``None``: each instance's list names itself (an empty one means implicit): a no-op.

The recorded order lives on the root module (``_PREFETCH_ORDER``).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from torch import nn

from . import _fsdp2_internals as internals

# on the root: the recorded order and whether the lists were set
_PREFETCH_ORDER = "_fsdp_conformance_prefetch_order"
# on each instance: its (forward_prefetch, backward_prefetch)
_PREFETCH_CONFIG = "_fsdp_conformance_prefetch_config"

_recording = threading.local()  # .root: weakref to the root whose forward is running


def configure_prefetch(module: nn.Module, config: dict[str, Any]) -> None:
    """Apply [Note: FSDP2 prefetch mapping] to a module just passed to ``fully_shard`` with the
    normalised wrap `config`."""
    forward = config.get("forward_prefetch", False)
    backward = config.get("backward_prefetch", "BACKWARD_PRE")
    setattr(module, _PREFETCH_CONFIG, (forward, backward))
    if backward is None:
        module.set_modules_to_backward_prefetch([module])
    if forward or backward == "BACKWARD_POST":
        module.register_forward_pre_hook(_record_order, prepend=True)
        module.register_forward_hook(_record_post_forward)


def _record_order(module: nn.Module, args: Any) -> None:
    # _is_root: None before the root's lazy init, True after
    if internals.is_root(internals.fsdp_state(module)) is not False:
        entry = getattr(module, _PREFETCH_ORDER, None)
        if entry is None:
            entry = {"order": [], "post": [], "applied": False}
            setattr(module, _PREFETCH_ORDER, entry)
        _recording.root = weakref.ref(module)
        if entry["order"] and not entry["applied"]:
            _apply(entry["order"], entry["post"])
            entry["applied"] = True
        if not entry["applied"]:
            entry["order"], entry["post"] = [module], []
        return
    entry = _recording_entry()
    if entry is not None and module not in entry["order"]:
        entry["order"].append(module)


def _record_post_forward(module: nn.Module, args: Any, output: Any) -> None:
    entry = _recording_entry()
    if entry is not None and module not in entry["post"]:
        entry["post"].append(module)


def _recording_entry() -> dict[str, Any] | None:
    root_ref = getattr(_recording, "root", None)
    root = None if root_ref is None else root_ref()
    entry = None if root is None else getattr(root, _PREFETCH_ORDER, None)
    return None if entry is None or entry["applied"] else entry


def _apply(order: list[nn.Module], post_forward_order: list[nn.Module]) -> None:
    for position, module in enumerate(order):
        forward, _ = getattr(module, _PREFETCH_CONFIG)
        if forward and position + 1 < len(order):
            module.set_modules_to_forward_prefetch([order[position + 1]])
    for position, module in enumerate(post_forward_order):
        _, backward = getattr(module, _PREFETCH_CONFIG)
        if backward == "BACKWARD_POST" and position > 0:
            module.set_modules_to_backward_prefetch([post_forward_order[position - 1]])
