"""The zoo models the suite trains, by name, with what each needs from an adapter and the
reference it is compared against: DistributedDataParallel, or DummyDDP for MixtureOfExperts
(its expert gradients are per rank; `run_backward` all-reduces the others by hand)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdp_conformance.adapters import Feature
from fsdp_conformance.models import (
    AlwaysWrapNestedWrappedModule,
    BufferedModule,
    DeviceInit,
    LoopModule,
    MixtureOfExperts,
    NestedWrappedModule,
    NestedWrappedModuleWithDelay,
    TiedInstances,
    TransformerWithSharedParams,
    UnevenModule,
)

# delays of the delay models (ms): long enough to reorder work, short enough for CI
DELAY_MS = 1.0

Builder = Callable[..., nn.Module]  # (group, wrap, *, device_init, device) -> zoo model


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """How the suite builds one zoo model."""

    name: str
    build: Builder
    # "ddp" (DistributedDataParallel) or "dummy_ddp" (the model reduces its own gradients)
    reference: str = "ddp"
    # adapter features needed beyond the wrap config (e.g. comm_trace for the delay hooks)
    features: tuple[str, ...] = ()


# per-instance gradient scales differing by orders of magnitude (models/loops.py)
LOOP_GAINS = (1.0, 40.0, 0.025)


def _loops(**options: Any) -> Builder:
    return functools.partial(LoopModule, **options)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("nested", NestedWrappedModule),
        ModelSpec("always_wrap", AlwaysWrapNestedWrappedModule),
        ModelSpec("transformer", TransformerWithSharedParams),
        # for mixed precision: fp32 BatchNorm statistics next to bf16 parameters fail
        ModelSpec(
            "transformer_without_batchnorm",
            functools.partial(TransformerWithSharedParams, add_bn=False),
        ),
        ModelSpec("mixture_of_experts", MixtureOfExperts, reference="dummy_ddp"),
        ModelSpec(
            "nested_with_delay",
            functools.partial(
                NestedWrappedModuleWithDelay,
                delay_after_loss_ms=DELAY_MS,
                delay_before_reduction_ms=DELAY_MS,
            ),
            features=(Feature.COMM_TRACE,),
        ),
        ModelSpec(
            "mixture_of_experts_with_delay",
            functools.partial(MixtureOfExperts, delay_before_free_ms=DELAY_MS),
            reference="dummy_ddp",
            features=(Feature.COMM_TRACE,),
        ),
        # the sharding checks' model: uneven and empty shards at world size 3
        ModelSpec("uneven", UnevenModule),
        ModelSpec("loops", _loops()),
        ModelSpec("loops_gains", _loops(gains=LOOP_GAINS)),
        ModelSpec(
            "loops_gains_no_shard",
            _loops(gains=LOOP_GAINS, no_shard_block=1),
            features=(Feature.NO_SHARD,),
        ),
        ModelSpec("loops_branch", _loops(branch=True)),
        ModelSpec("loops_buffer", _loops(buffer=True)),
        ModelSpec("loops_norm", _loops(norm=True)),
        ModelSpec("tied_instances", TiedInstances),
        ModelSpec("loops_frozen", _loops(freeze="instance"), features=(Feature.FROZEN_PARAMETERS,)),
        ModelSpec(
            "loops_frozen_mixed",
            _loops(freeze="mixed"),
            features=(Feature.FROZEN_PARAMETERS_MIXED,),
        ),
        # the full-state-dict and meta-init checks' model (models/buffered.py)
        ModelSpec("buffered", functools.partial(BufferedModule, meta=False)),
        ModelSpec(
            "buffered_meta",
            functools.partial(BufferedModule, meta=True),
            features=(Feature.META_INIT,),
        ),
    )
}
# the models of the parity check
MODEL_NAMES = tuple(
    name
    for name in MODELS
    if name not in ("transformer_without_batchnorm", "uneven", "tied_instances")
    and not name.startswith(("loops", "buffered"))
)


def build(
    name: str, group: Any, wrap: Any, device: torch.device, device_init: str = "after"
) -> nn.Module:
    """The zoo model `name`, built for `device` the way `device_init` says."""
    spec = MODELS[name]
    return spec.build(group, wrap, device_init=DeviceInit(device_init), device=device)
