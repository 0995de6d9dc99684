"""``StateDictMixin`` (a base of ``FullyShardedDataParallel``): full and sharded state dicts,
both walking the same ``StateEntry``s."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from .api import ShardedFlatParameter, StateDictType
from .forward import summon_full_params
from .state import FSDPState, fsdp_states, state_of


class StateEntry(NamedTuple):
    """One state-dict entry under an FSDP instance.

    ``kind``: "flat" (an instance's flat parameter, sharded form only; ``module`` is the
    instance, ``attr`` None), "param" (an original parameter it holds, full form only), "plain"
    (a parameter FSDP does not manage) or "buffer" (persistent). ``name``: the key without the
    caller's prefix, wrapper segments removed.
    """

    kind: str
    name: str
    module: nn.Module
    attr: str | None


class ShardTypeError(TypeError, ValueError):
    """A sharded state-dict entry is not a ``ShardedFlatParameter`` (also a ``ValueError``, so
    that existing handlers still catch it)."""


class StateDictMixin:
    _fsdp_state: FSDPState

    def _state_entries(self) -> Iterator[StateEntry]:
        owned: dict[int, dict[str, None]] = {}  # module id -> its managed names, in order
        for state in fsdp_states(self._fsdp_state.owner):
            if state.handle is not None:
                for slot in state.handle.slots:
                    owned.setdefault(id(slot.module), {})[slot.name] = None

        def walk(module: nn.Module, prefix: str) -> Iterator[StateEntry]:
            state = state_of(module)
            if state is not None:  # an FSDP instance
                if state.handle is not None:
                    yield StateEntry("flat", prefix + "_flat_param", module, None)
                module = state.module
            for name in owned.get(id(module), ()):
                yield StateEntry("param", prefix + name, module, name)
            for name, param in module._parameters.items():
                if param is not None:
                    yield StateEntry("plain", prefix + name, module, name)
            for name, buffer in module._buffers.items():
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    yield StateEntry("buffer", prefix + name, module, name)
            for name, child in module._modules.items():
                if child is not None:
                    yield from walk(child, prefix + name + ".")

        return walk(self, "")

    def state_dict(  # type: ignore[override]
        self,
        *args: Any,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
        state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
    ) -> dict[str, Any]:
        """Full (a collective) or sharded state dict; ``destination``, ``prefix`` and
        ``keep_vars`` as ``nn.Module.state_dict``. Full form only: ``rank0_only`` (other ranks
        return an empty dict), ``offload_to_cpu``."""
        if args:
            destination, prefix, keep_vars = (
                list(args) + [destination, prefix, keep_vars][len(args) :]
            )[:3]
        result: dict[str, Any] = destination if destination is not None else {}
        if state_dict_type == StateDictType.SHARDED_STATE_DICT:
            for entry in self._state_entries():
                if entry.kind == "flat":
                    handle = state_of(entry.module).handle
                    shard = handle.flat_param.detach().clone()
                    result[prefix + entry.name] = ShardedFlatParameter(
                        shard, handle.rank, handle.world_size, handle.numel
                    )
                elif entry.kind != "param":
                    result[prefix + entry.name] = self._value(entry)
            return result
        with summon_full_params(self._fsdp_state, False, rank0_only, offload_to_cpu, True):
            if rank0_only and dist.get_rank() != 0:
                return result
            for entry in self._state_entries():
                if entry.kind != "flat":
                    value = self._value(entry)
                    result[prefix + entry.name] = value.cpu() if offload_to_cpu else value
        return result

    def _value(self, entry: StateEntry) -> torch.Tensor:
        """A copy of a "param", "plain" or "buffer" entry's tensor (buffers in their original
        dtype)."""
        if entry.kind != "buffer":
            return entry.module._parameters[entry.attr].detach().clone()
        buffer = entry.module._buffers[entry.attr].detach().clone()
        dtype = self._fsdp_state.orig_buffer_dtypes.get((id(entry.module), entry.attr))
        return buffer.to(dtype) if dtype is not None else buffer

    def load_state_dict(  # type: ignore[override]
        self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """Load a full (a collective; also an unwrapped module's) or sharded state dict.

        ``assign`` is accepted, but values are copied into the flat parameter (the original
        parameters are views of it and cannot adopt the given tensors).
        """
        entries = list(self._state_entries())
        sharded = any(isinstance(v, ShardedFlatParameter) for v in state_dict.values())
        skipped_kind = "param" if sharded else "flat"  # the entries of the other form
        expected = [entry for entry in entries if entry.kind != skipped_kind]
        expected_names = {entry.name for entry in expected}
        missing = [entry.name for entry in expected if entry.name not in state_dict]
        unexpected = [k for k in state_dict if k not in expected_names]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Error loading state dict into FSDP instance {self._fsdp_state.name()}: "
                f"missing keys {missing}, unexpected keys {unexpected}; pass strict=False to skip "
                "them"
            )
        present = [entry for entry in expected if entry.name in state_dict]
        flats = [entry for entry in present if entry.kind == "flat"]  # the sharded form only
        for entry in flats:
            _check_shard(entry.name, state_of(entry.module), state_dict[entry.name])
        # the full form loads into the summoned parameters, written back on exit
        summoned = summon_full_params(self._fsdp_state, True, False, False, True)
        with torch.no_grad(), contextlib.nullcontext() if sharded else summoned:
            for entry in present:
                if entry.kind == "flat":
                    state_of(entry.module).handle.flat_param.copy_(state_dict[entry.name].shard)
                elif entry.kind == "buffer":
                    entry.module._buffers[entry.attr].copy_(state_dict[entry.name])
                else:
                    entry.module._parameters[entry.attr].copy_(state_dict[entry.name])
        return _IncompatibleKeys(missing, unexpected)


def _check_shard(name: str, state: FSDPState, value: Any) -> None:
    """Raise unless ``value`` is this rank's shard of ``state``'s flat parameter."""
    handle = state.handle
    if not isinstance(value, ShardedFlatParameter):
        raise ShardTypeError(
            f"state dict entry '{name}' must be a ShardedFlatParameter from "
            f"state_dict(state_dict_type=SHARDED_STATE_DICT), got {type(value).__name__}"
        )
    if value.world_size != handle.world_size:
        raise ValueError(
            f"sharded state dict entry '{name}' was saved with world size {value.world_size} but "
            f"FSDP instance {state.name()} has a process group of size "
            f"{handle.world_size}; load a full state dict (FULL_STATE_DICT) to change world size"
        )
    if value.rank != handle.rank:
        raise ValueError(
            f"sharded state dict entry '{name}' holds rank {value.rank}'s shard but this is rank "
            f"{handle.rank}; each rank must load its own shard"
        )
    if value.unpadded_numel != handle.numel or value.shard.numel() != handle.shard_numel:
        raise ValueError(
            f"sharded state dict entry '{name}' has {value.unpadded_numel} elements "
            f"(shard {value.shard.numel()}) but FSDP instance {state.name()} has "
            f"{handle.numel} (shard {handle.shard_numel}); the model differs from the saved one"
        )
