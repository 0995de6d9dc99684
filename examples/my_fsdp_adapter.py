"""my_fsdp_adapter.py -- torch FSDP1 adapted as a newcomer would (docs/adapters.md, the tutorial).

From this folder:

    fsdp-conformance coverage --impl my_fsdp_adapter:ADAPTER    # what runs, what to add next
    fsdp-conformance run --impl my_fsdp_adapter:ADAPTER --report matrix.md
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from fsdp_conformance.adapters import (
    ALL_FEATURES,
    Adapter,
    Declarations,
    Feature,
    InstanceState,
    RootState,
    module_predicate,
)
from fsdp_conformance.adapters.torch_fsdp1 import (
    FSDP1_DEVIATIONS,
    install_fsdp1_device_handle,
    label_instances,
    observe_fsdp1,
)

# Step 2 (features, in the order that unlocks the most cells); everything else skips with the
# reason below, naming the adapter and the feature
SUPPORTED = frozenset(
    {
        Feature.TRAINING_STATES,  # training_state / root_state below
        Feature.SUMMON_FULL_PARAMS,  # _summon_full_params below
        Feature.FULL_SHARD,
        Feature.SHARD_GRAD_OP,
        Feature.NO_SHARD,
        Feature.BACKWARD_PREFETCH_PRE,
        Feature.BACKWARD_PREFETCH_POST,
        Feature.BACKWARD_PREFETCH_NONE,
        Feature.FORWARD_PREFETCH,
        Feature.COMM_TRACE,  # _observe below
        Feature.DEVICE_HANDLE,  # _install_device_handle below
        Feature.LIMIT_ALL_GATHERS,
        Feature.LIMIT_ALL_GATHERS_OFF,
        Feature.AUTO_WRAP_POLICY,
        Feature.USE_ORIG_PARAMS,
        Feature.SUMMON_FULL_PARAMS_WRITEBACK,
        # the training loops: FSDP1's own no_sync() / clip_grad_norm_() on the root
        Feature.GRADIENT_ACCUMULATION,
        Feature.CLIP_GRAD_NORM,
        Feature.FROZEN_PARAMETERS,
        Feature.FROZEN_PARAMETERS_MIXED,
        Feature.ACTIVATION_CHECKPOINTING,
        Feature.FORWARD_VARIANTS,
    }
)


class MyFSDPAdapter(Adapter):
    name = "my-fsdp"
    declarations = Declarations(
        unsupported={
            feature: "not wired up in my-fsdp yet" for feature in ALL_FEATURES - SUPPORTED
        },
        # Step 3: what torch FSDP1 does differently, each with its reproduction
        # (tests/adapters/test_measured_torch_facts.py, docs/memory_bound.md)
        known_deviations=FSDP1_DEVIATIONS,
    )

    # Step 1: the minimum adapter
    def _wrap(self, module, process_group, config):
        # config holds only the keys the check gave, normalised (docs/adapters.md)
        device = config.get("device_id")  # None, a torch.device or an int
        if device is None:  # the rank's GPU; on a CPU-only host FSDP1 needs device_id=cpu
            cuda = torch.cuda.is_available()
            device = torch.cuda.current_device() if cuda else torch.device("cpu")
        kwargs = {"device_id": device}
        if "sharding_strategy" in config:
            kwargs["sharding_strategy"] = ShardingStrategy[config["sharding_strategy"]]
        if "backward_prefetch" in config:
            prefetch = config["backward_prefetch"]  # None means "off"
            kwargs["backward_prefetch"] = None if prefetch is None else BackwardPrefetch[prefetch]
        for key in ("forward_prefetch", "limit_all_gathers", "use_orig_params"):
            if key in config:
                kwargs[key] = config[key]
        if config.get("auto_wrap_policy") is not None:
            wraps = module_predicate(config["auto_wrap_policy"])  # "always" or a predicate

            def policy(module, recurse, nonwrapped_numel):  # FSDP1 passes them by keyword
                return recurse or wraps(module)

            kwargs["auto_wrap_policy"] = policy
        model = FSDP(module, process_group=process_group, **kwargs)
        label_instances(model)  # for observe_fsdp1
        return model

    def unwrap(self, model):
        return model.module if isinstance(model, FSDP) else model

    def instances(self, model):
        return FSDP.fsdp_modules(model)  # pre-order: the root first

    def training_state(self, instance):
        if instance._handle is None:  # no parameters: FSDP1 keeps no instance state
            raise ValueError(f"{type(instance).__name__} has no parameters; use root_state()")
        return InstanceState[instance._handle._training_state.name]

    def root_state(self, instance):
        return RootState[instance.training_state.name]

    def _summon_full_params(self, model, writeback):
        return FSDP.summon_full_params(model, writeback=writeback)

    # Step 2: the hooks the comm-trace and memory checks need (FSDP1 has no public ones)
    def _observe(self, callback, instances):
        return observe_fsdp1(callback, instances)

    def _install_device_handle(self, model, handle):
        install_fsdp1_device_handle(self.name, model, handle)


ADAPTER = MyFSDPAdapter()
