"""The suite's prefetch settings in torch FSDP2's terms: explicit lists from the recorded order.

[Note: FSDP2 prefetch mapping]
torch FSDP2 (2.8.0 to 2.15.0) prefetches in two places: in forward, the modules named by
``set_modules_to_forward_prefetch`` (none by default); in backward, at each instance's
pre-backward, the modules named by ``set_modules_to_backward_prefetch``, or -- when that list is
empty -- the instance before it in the post-forward order (implicit). The suite's settings map
to those lists:

- ``forward_prefetch=True``: like torch FSDP1, the order of the first iteration's forward is
  recorded (a forward pre-hook on each instance) and, from the second forward on, each instance
  prefetches the one after it in that order. Iteration 1 does not prefetch in forward.
- ``backward_prefetch="BACKWARD_PRE"`` (and the key not given): FSDP2's implicit prefetch, the
  one-ahead prefetch at pre-backward.
- ``backward_prefetch="BACKWARD_POST"``: FSDP2 has no post-backward prefetch point; the same
  one-ahead target is given as an explicit list (the instance before it in the first
  iteration's recorded post-forward order, the reverse of which is the backward order), issued
  at pre-backward.
- ``backward_prefetch=None``: an empty list means "implicit" to FSDP2, so each instance's list
  names the instance itself; its pre-backward has unsharded it just before, so that prefetch is
  a no-op and nothing else is prefetched.

The recorded order lives on the root module (``_PREFETCH_ORDER``) and dies with the model.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from torch import nn

from . import _fsdp2_internals as internals

# attribute on the root module: the recorded order and whether the lists were set
_PREFETCH_ORDER = "_fsdp_conformance_prefetch_order"
# attribute on each instance: (forward_prefetch, backward_prefetch) it was wrapped with
_PREFETCH_CONFIG = "_fsdp_conformance_prefetch_config"

_recording = threading.local()  # .root: weakref to the root whose forward is running


def configure_prefetch(module: nn.Module, forward: bool, backward: Any, given: bool) -> None:
    """Apply the mapping to one ``fully_shard``-ed module (see [Note: FSDP2 prefetch mapping]).

    Args:
        module: the module just passed to ``fully_shard``.
        forward: ``forward_prefetch``.
        backward: ``backward_prefetch`` (None, "BACKWARD_PRE" or "BACKWARD_POST").
        given: whether ``backward_prefetch`` was given at all.
    """
    setattr(module, _PREFETCH_CONFIG, (forward, backward if given else "BACKWARD_PRE"))
    if given and backward is None:
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
    """The order being recorded by the running root's first forward, if any."""
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
