"""The model zoo (`fsdp_conformance.models`): FSDP test models, implementation-free.

Every model takes the process group and a `wrap` callable (`wrap(module, **overrides)`; None =
the unwrapped reference), is seeded without the global RNG, and has `get_input(device)`,
`get_loss(input, output)` and `run_backward(loss)`. The caller wraps the root, with the model's
`ROOT_WRAP_CONFIG` merged into its config.
"""

from __future__ import annotations

from .buffered import BufferedBlock, BufferedModule
from .ddp import DummyDDP
from .delay import cycles_per_ms, sleep_cycles, sleep_ms
from .layer import Layer
from .loops import CheckpointedModule, CheckpointingWrap, LoopModule
from .model_base import DelayHooks, DeviceInit, Wrap, move_after_wrap
from .moe import MixtureOfExperts
from .nested import ALWAYS_WRAP, AlwaysWrapNestedWrappedModule, NestedWrappedModule
from .tied import TiedInstances
from .transformer import TransformerWithSharedParams
from .uneven import UnevenModule
from .with_delay import ModuleWithDelay, NestedWrappedModuleWithDelay

__all__ = [
    "ALWAYS_WRAP",
    "AlwaysWrapNestedWrappedModule",
    "BufferedBlock",
    "BufferedModule",
    "CheckpointedModule",
    "CheckpointingWrap",
    "DelayHooks",
    "DeviceInit",
    "DummyDDP",
    "Layer",
    "LoopModule",
    "MixtureOfExperts",
    "ModuleWithDelay",
    "NestedWrappedModule",
    "NestedWrappedModuleWithDelay",
    "TiedInstances",
    "TransformerWithSharedParams",
    "UnevenModule",
    "Wrap",
    "cycles_per_ms",
    "move_after_wrap",
    "sleep_cycles",
    "sleep_ms",
]
