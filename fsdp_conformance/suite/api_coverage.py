"""The public API of torch FSDP1 and FSDP2, read off the running torch, and which checks drive it.

[Note: API surface]
Every item is derived from a live signature (``inspect.signature``, ``dataclasses.fields``, enum
members), never listed by hand:

  FullyShardedDataParallel(sharding_strategy)        a parameter driven with a non-default value
  FullyShardedDataParallel(limit_all_gathers=False)  a bool: its non-default value
  fully_shard(reshard_after_forward=int)             one form per member of a union annotation
                                                     (a bool member: both values)
  FullyShardedDataParallel(backward_prefetch=None)   None, where the default is something else
  FullyShardedDataParallel.no_sync()                 a public method or function, called
  FSDPModule.set_requires_gradient_sync(recurse=False) ... and its optional parameters
  MixedPrecision(keep_low_precision_grads=True)      a config dataclass's fields, the same way
  ShardingStrategy.HYBRID_SHARD                      each public enum member

A check declares the items it drives (``@check(..., api=(...))``, ``checks.Check.api``);
``docs/api_coverage.md`` is ``table()``: each item with the checks driving it or, for the few in
``OUT_OF_SCOPE``, why none can here. ``tests/suite/test_api_coverage.py`` fails when the running
torch has an item the table lacks, or the table is stale. Regenerate:
``python -m fsdp_conformance.suite.api_coverage > docs/api_coverage.md``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import torch
from torch.distributed import fsdp

from fsdp_conformance import checks

_FSDP1_OFFLOAD = (
    "needs an accelerator in torch FSDP1 (on a CPU host forward fails: 'Cannot access "
    "accelerator device when none is available'); parity.ddp's offload cells drive it on a GPU host"
)
# item -> why no check can drive it on a CPU host with gloo (at most 12)
OUT_OF_SCOPE = {
    "FSDPModule.set_post_optim_event()": "CUDA-only: takes a CUDA event the all-gather stream waits on",
    "FSDPModule.set_symm_mem_for_comm()": "CUDA-only: NCCL symmetric memory",
    "FSDPModule.set_symm_mem_for_comm(backend)": "CUDA-only: its one backend is 'NCCL'",
    "FullyShardedDataParallel(cpu_offload)": _FSDP1_OFFLOAD,
    "CPUOffload(offload_params=True)": _FSDP1_OFFLOAD,
    "FullyShardedDataParallel(sync_module_states=True)": (
        "needs an accelerator in torch FSDP1 (on a CPU host the wrap refuses CPU modules even "
        "with device_id=cpu); misuse.sync_module_states_shapes drives it on a GPU host"
    ),
    "FSDPModule.set_all_reduce_hook(stream)": (
        "CUDA-only: a torch.cuda.Stream to run the hook on (the hook itself is driven)"
    ),
    "FSDPModule.set_allocate_memory_from_process_group_for_comm()": (
        "CUDA-only: NCCL memory pools for the communication buffers"
    ),
}


def _short(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", text).replace("typing.", "")


def _members(annotation: Any) -> list[str]:
    """The members of a union annotation, None dropped, as short names (``"bool"``, ``"int"``,
    ``"tuple[ProcessGroup, ProcessGroup]"``)."""
    text, members, depth, start = _short(annotation), [], 0, 0
    for index, char in enumerate(text + "|"):
        depth += char in "[(" and 1 or char in "])" and -1 or 0
        if char == "|" and depth == 0:
            members.append(text[start:index].strip())
            start = index + 1
    return [member for member in members if member not in ("None", "NoneType", "")]


def _forms(owner: str, name: str, annotation: Any, default: Any) -> list[str]:
    """The items of one parameter or field (see [Note: API surface])."""
    members = _members(annotation) if annotation is not inspect.Parameter.empty else []
    if default is not None and default is not inspect.Parameter.empty and members == ["bool"]:
        return [f"{owner}({name}={not default})"]
    if set(members) == {"float", "int"}:  # a number, however written
        members = ["float"]
    forms = []
    if len(members) > 1 or members == ["bool"]:
        for member in members:
            values = ("True", "False") if member == "bool" else (member,)
            forms += [f"{owner}({name}={value})" for value in values]
    else:
        forms.append(f"{owner}({name})")
    if (
        default is not None
        and default is not inspect.Parameter.empty
        and "None" in _short(annotation)
    ):
        forms.append(f"{owner}({name}=None)")
    return forms


def _callable_items(owner: str, function: Any, skip: int = 0) -> list[str]:
    items = [f"{owner}()"]
    parameters = list(inspect.signature(function).parameters.values())[skip:]
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        required = parameter.default is inspect.Parameter.empty
        if required and len(_members(parameter.annotation)) < 2:
            continue
        items += _forms(owner, parameter.name, parameter.annotation, parameter.default)
    return items


def _class_items(cls: type, skip_first: bool) -> list[str]:
    items = []
    for name, attribute in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(attribute, property):
            items.append(f"{cls.__name__}.{name}")
        elif callable(attribute) or isinstance(attribute, (staticmethod, classmethod)):
            static = isinstance(attribute, staticmethod)
            items += _callable_items(
                f"{cls.__name__}.{name}", getattr(cls, name), skip=0 if static else 1
            )
    return items


def _config_items(cls: type) -> list[str]:
    items = []
    for field in dataclasses.fields(cls):
        default = None if field.default is dataclasses.MISSING else field.default
        items += _forms(cls.__name__, field.name, field.type, default)
    return items


CONFIGS = (
    "MixedPrecision",
    "CPUOffload",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "LocalStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "MixedPrecisionPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
)
ENUMS = ("ShardingStrategy", "BackwardPrefetch", "StateDictType", "OptimStateKeyType")


def surface() -> list[str]:
    """Every public item of torch FSDP1 and FSDP2 in the running torch, in a stable order."""
    items = _callable_items("FullyShardedDataParallel", fsdp.FullyShardedDataParallel, skip=1)
    items += _class_items(fsdp.FullyShardedDataParallel, skip_first=True)
    items += _callable_items("fully_shard", fsdp.fully_shard, skip=0)
    items.append("fully_shard(module=list)")  # its overloads: one module or a list of them
    items += _class_items(fsdp.FSDPModule, skip_first=True)
    items += _class_items(fsdp.UnshardHandle, skip_first=True)
    for function in ("register_fsdp_forward_method", "share_comm_ctx"):
        items += _callable_items(function, getattr(fsdp, function))
    for name in CONFIGS:
        if hasattr(fsdp, name):
            items += _config_items(getattr(fsdp, name))
    for name in ENUMS:
        members = getattr(fsdp, name).__members__
        items += [f"{name}.{member}" for member in members if not member.startswith("_")]
    return list(dict.fromkeys(items))


def drivers() -> dict[str, list[str]]:
    """item -> the ids of the registered checks declaring it (import the suite first)."""
    driven: dict[str, list[str]] = {}
    for check in checks.CHECKS.values():
        for item in check.api:
            driven.setdefault(item, []).append(check.id)
    return driven


def table() -> str:
    """docs/api_coverage.md: every item of ``surface()`` with what drives it."""
    items, driven = surface(), drivers()
    in_scope = [item for item in items if item not in OUT_OF_SCOPE]
    lines = [
        "# The FSDP API surface and the checks that drive it",
        "",
        (
            f"Generated from torch {torch.__version__.split('+')[0]}'s own signatures by "
            "`python -m fsdp_conformance.suite.api_coverage > docs/api_coverage.md` "
            "([Note: API surface] in `fsdp_conformance/suite/api_coverage.py`); "
            "`tests/suite/test_api_coverage.py` fails when it is stale. "
            f"{len(items)} items: {sum(item in driven for item in in_scope)} driven, "
            f"{len(OUT_OF_SCOPE)} out of scope. Each check asserts the item's promise against a "
            "reference (docs/checks.md)."
        ),
        "",
        "| item | driven by |",
        "|---|---|",
    ]
    for item in items:
        if item in OUT_OF_SCOPE:
            cell = f"out of scope: {OUT_OF_SCOPE[item]}"
        else:
            cell = ", ".join(f"`{check}`" for check in driven.get(item, [])) or "**not driven**"
        lines.append(f"| `{item}` | {cell} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import fsdp_conformance.suite  # noqa: F401  (registers the checks)

    print(table(), end="")
