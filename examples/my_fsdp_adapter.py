"""my_fsdp_adapter.py -- run the suite with: pytest --pyargs fsdp_conformance.suite
--fsdp-impl my_fsdp_adapter:ADAPTER"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

from fsdp_conformance.adapters import ALL_FEATURES, Adapter, Feature, InstanceState, RootState


class MyFSDPAdapter(Adapter):
    name = "my-fsdp"

    # what this adapter claims; everything else skips with the reason below
    SUPPORTED = frozenset(
        {
            Feature.FULL_SHARD,
            Feature.SHARD_GRAD_OP,
            Feature.TRAINING_STATES,
            Feature.SUMMON_FULL_PARAMS,
        }
    )

    def unsupported(self) -> dict[str, str]:
        reason = "not wired up in my-fsdp yet"
        return {feature: reason for feature in ALL_FEATURES - self.SUPPORTED}

    def _wrap(self, module, process_group, config):
        kwargs = {"device_id": torch.device("cpu")}  # CPU-only host: FSDP1 needs it
        if "sharding_strategy" in config:  # normalised to a string by the base class
            kwargs["sharding_strategy"] = ShardingStrategy[config["sharding_strategy"]]
        return FSDP(module, process_group=process_group, **kwargs)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, FSDP) else model

    def instances(self, model):
        return FSDP.fsdp_modules(model)

    def training_state(self, instance):
        return InstanceState[instance._handle._training_state.name]

    def root_state(self, instance):
        return RootState[instance.training_state.name]

    def is_unsharded(self, instance):
        flat = instance._handle._get_padded_unsharded_flat_param()
        return flat.untyped_storage().size() > 0

    def _summon_full_params(self, model, writeback):
        return FSDP.summon_full_params(model, writeback=writeback)


ADAPTER = MyFSDPAdapter()
