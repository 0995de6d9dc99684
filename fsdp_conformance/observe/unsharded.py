"""Which unsharded parameters an FSDP instance used in its forward, and which are still alive.

[Note: unsharded parameters by value]
No implementation internals: a ``TorchFunctionMode`` sees every tensor each torch function gets
while forward runs, attributed to the innermost instance whose forward runs. A tensor is an
*unsharded parameter* when it has the shape of a full parameter (``adapter.full_params``) and
equals it in the tensor's own dtype. Only a weak reference is kept; after the forward the
tensor is *alive* while the reference resolves and its storage has bytes (FSDP1/2, fairscale
and impl resize the storage to 0; DeepSpeed swaps ``param.data``; others drop the tensor).
``seen``: instance label -> {full parameter name: dtype} used in its forward; ``alive``:
instance label -> names still alive when the forward returned.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fsdp_conformance.adapters import Adapter
from fsdp_conformance.observe.comm_trace import instance_labels


class UnshardedParams(TorchFunctionMode):
    """The unsharded parameters each instance of `root` uses in forward (see the Note);
    ``full``: ``adapter.full_params(root)``, read after the last optimizer step."""

    def __init__(self, adapter: Adapter, root: nn.Module, full: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.instances = adapter.instances(root)
        self.labels = instance_labels(adapter, root)
        self.root_label = self.labels[id(self.instances[0])] if self.instances else ""
        self._by_shape: dict[tuple[int, ...], list[tuple[str, torch.Tensor]]] = {}
        for name, value in full.items():
            self._by_shape.setdefault(tuple(value.shape), []).append((name, value.detach()))
        self._active: list[str] = []  # labels of the instances whose forward runs, innermost last
        self._refs: dict[str, dict[str, list[weakref.ref]]] = {}
        self._handles: list[Any] = []
        self.seen: dict[str, dict[str, torch.dtype]] = {}
        self.alive: dict[str, list[str]] = {}

    def __enter__(self) -> UnshardedParams:  # noqa: PYI034
        for instance in self.instances:
            label = self.labels[id(instance)]
            push = instance.register_forward_pre_hook(lambda *_, label=label: self._push(label))
            self._handles += [push, instance.register_forward_hook(lambda *_: self._pop())]
        return super().__enter__()

    def __exit__(self, *exc_info: object) -> None:
        super().__exit__(*exc_info)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.alive = {
            label: sorted(name for name, refs in names.items() if any(map(_alive, refs)))
            for label, names in self._refs.items()
        }

    def _push(self, label: str) -> None:
        self._active.append(label)

    def _pop(self) -> None:
        if self._active:
            self._active.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self._active:
            for value in (*args, *(kwargs or {}).values()):
                if type(value) in (torch.Tensor, nn.Parameter):
                    self._match(value)
        return func(*args, **(kwargs or {}))

    def _match(self, tensor: torch.Tensor) -> None:
        if not tensor.is_floating_point() or tensor.untyped_storage().nbytes() == 0:
            return
        for name, value in self._by_shape.get(tuple(tensor.shape), ()):
            with torch.no_grad():
                same = torch.equal(tensor.detach(), value.to(tensor.device, tensor.dtype))
            if same:
                label = self._active[-1]
                self.seen.setdefault(label, {})[name] = tensor.dtype
                self._refs.setdefault(label, {}).setdefault(name, []).append(weakref.ref(tensor))
                return


def _alive(ref: weakref.ref) -> bool:
    tensor = ref()
    return tensor is not None and tensor.untyped_storage().nbytes() > 0
