"""Config vocabulary, feature mapping, declared capabilities and skip reasons (one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters import (
    ALL_FEATURES,
    ALWAYS_WRAP,
    LEGAL_INSTANCE_TRANSITIONS,
    LEGAL_ROOT_TRANSITIONS,
    Adapter,
    Declarations,
    Feature,
    InstanceState,
    MixedPrecisionConfig,
    RootState,
    UnsupportedFeatureError,
    _dcp,
    get_adapter,
    normalize_config,
)
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters.base import delay_before_reduction
from fsdp_conformance.device_handle import accelerator_available

cpu_only = pytest.mark.skipif(accelerator_available(), reason="facts about CPU-only hosts")


def test_config_values_accept_strings_and_any_enum():
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, ShardingStrategy

    config = normalize_config(
        {
            "sharding_strategy": ShardingStrategy.SHARD_GRAD_OP,
            "backward_prefetch": "backward_post",
            "cpu_offload": CPUOffload(offload_params=True),
            "mixed_precision": {"param_dtype": torch.bfloat16},
            "limit_all_gathers": 0,
        }
    )
    assert config == {
        "sharding_strategy": "SHARD_GRAD_OP",
        "backward_prefetch": "BACKWARD_POST",
        "cpu_offload": True,
        "mixed_precision": MixedPrecisionConfig(param_dtype=torch.bfloat16),
        "limit_all_gathers": False,
    }
    assert normalize_config({"backward_prefetch": BackwardPrefetch.BACKWARD_PRE}) == {
        "backward_prefetch": "BACKWARD_PRE"
    }
    assert normalize_config({"backward_prefetch": None}) == {"backward_prefetch": None}


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"sharding": "FULL_SHARD"}, TypeError, r"unknown wrap config key\(s\) \['sharding'\]"),
        ({"sharding_strategy": "HYBRID"}, ValueError, r"sharding_strategy='HYBRID' is not one"),
        ({"backward_prefetch": "PRE"}, ValueError, r"backward_prefetch='PRE'"),
        ({"auto_wrap_policy": 3}, ValueError, r"auto_wrap_policy=3"),
        ({"mixed_precision": {"dtype": 1}}, TypeError, r"mixed_precision keys \['dtype'\]"),
    ],
)
def test_bad_config_names_the_key(config, error, match):
    with pytest.raises(error, match=match):
        normalize_config(config)


def test_features_for_maps_each_config_key():
    assert adapter_features.wrap_features() == frozenset()
    assert adapter_features.wrap_features(
        sharding_strategy="NO_SHARD",
        backward_prefetch=None,
        forward_prefetch=True,
        limit_all_gathers=False,
        cpu_offload=True,
        mixed_precision={"param_dtype": torch.float16, "buffer_dtype": torch.float16},
        auto_wrap_policy=ALWAYS_WRAP,
        sync_module_states=True,
        device_id=torch.device("cpu"),
    ) == {
        Feature.NO_SHARD,
        Feature.BACKWARD_PREFETCH_NONE,
        Feature.FORWARD_PREFETCH,
        Feature.LIMIT_ALL_GATHERS,
        Feature.CPU_OFFLOAD,
        Feature.MIXED_PRECISION,
        Feature.MIXED_PRECISION_BUFFER_DTYPE,
        Feature.AUTO_WRAP_POLICY,
        Feature.SYNC_MODULE_STATES,
    }
    assert adapter_features.wrap_features(
        backward_prefetch="BACKWARD_PRE", forward_prefetch=False, cpu_offload=False
    ) == {Feature.BACKWARD_PREFETCH_PRE}


@cpu_only
def test_torch_fsdp1_declares_cpu_host_limits_with_reasons():
    adapter = get_adapter("torch-fsdp1")
    lacking = {Feature.CPU_OFFLOAD, Feature.SYNC_MODULE_STATES, Feature.FORWARD_METHOD}
    lacking.add(Feature.FSDP2_API)  # it declares torch FSDP1's API family only
    if _dcp.fsdp1_group_dropped():  # before torch 2.13 ([Note: DCP on a subgroup with FSDP1])
        lacking.add(Feature.CHECKPOINT_RESUME)
    assert set(dict(adapter.declarations.unsupported)) == lacking
    assert "accelerator" in adapter_features.why_unsupported(adapter, Feature.CPU_OFFLOAD)
    assert "sync_module_states" in adapter_features.why_unsupported(
        adapter, Feature.SYNC_MODULE_STATES
    )
    assert "other than forward" in adapter_features.why_unsupported(adapter, Feature.FORWARD_METHOD)
    assert adapter_features.capabilities(adapter) == ALL_FEATURES - lacking


def test_torch_fsdp2_declares_what_fully_shard_cannot_express():
    adapter = get_adapter("torch-fsdp2")
    assert {
        Feature.LIMIT_ALL_GATHERS_OFF,
        Feature.SYNC_MODULE_STATES,
        Feature.ASSERT_STATE,
    } <= set(dict(adapter.declarations.unsupported))
    # expressed in FSDP2's own terms (explicit prefetch lists, its own memory bound)
    assert adapter_features.supports(
        adapter,
        Feature.FULL_SHARD,
        Feature.SHARD_GRAD_OP,
        Feature.CPU_OFFLOAD,
        Feature.COMM_TRACE,
        Feature.AUTO_WRAP_POLICY,
        Feature.DEVICE_HANDLE,
        Feature.LIMIT_ALL_GATHERS,
        Feature.FORWARD_PREFETCH,
        Feature.NO_SHARD,
        Feature.BACKWARD_PREFETCH_NONE,
        Feature.BACKWARD_PREFETCH_POST,
    )
    for feature, reason in dict(adapter.declarations.unsupported).items():
        assert feature in ALL_FEATURES and reason.strip(), feature


def test_require_skips_naming_adapter_feature_and_reason():
    adapter = get_adapter("torch-fsdp2")
    adapter_features.skip_unless(adapter, Feature.FULL_SHARD)  # supported: no skip
    with pytest.raises(pytest.skip.Exception) as info:
        adapter_features.skip_unless(adapter, Feature.FULL_SHARD, Feature.LIMIT_ALL_GATHERS_OFF)
    message = str(info.value)
    assert "'torch-fsdp2'" in message and "'limit_all_gathers_off'" in message
    assert "cannot be switched off" in message


def test_unsupported_config_raises_before_touching_the_module():
    adapter = get_adapter("torch-fsdp2")
    with pytest.raises(
        UnsupportedFeatureError, match="'torch-fsdp2' does not support 'mixed_precision_buffer"
    ):
        adapter.wrap(nn.Linear(2, 2), mixed_precision={"buffer_dtype": torch.float16})
    with pytest.raises(UnsupportedFeatureError) as info:
        adapter.wrapper(sync_module_states=True)
    assert (info.value.adapter, info.value.feature) == ("torch-fsdp2", Feature.SYNC_MODULE_STATES)
    with pytest.raises(UnsupportedFeatureError, match="summon_full_params_writeback"):
        adapter.summon_full_params(nn.Linear(2, 2), writeback=True)


def test_unknown_feature_name_is_an_error_not_a_skip():
    with pytest.raises(ValueError, match="unknown feature 'limit_allgathers'"):
        adapter_features.why_unsupported(get_adapter("torch-fsdp1"), "limit_allgathers")


def test_base_adapter_optional_hooks_are_undeclared_features():
    class Minimal(Adapter):
        name = "minimal"
        declarations = Declarations(
            unsupported={
                Feature.COMM_TRACE: "no observer hooks",
                Feature.DEVICE_HANDLE: "no handle",
            }
        )

    adapter = Minimal()
    with pytest.raises(UnsupportedFeatureError, match="'minimal' does not support 'comm_trace'"):
        adapter.observe(lambda *args: None)
    with pytest.raises(UnsupportedFeatureError, match="device_handle"):
        adapter.install_device_handle(nn.Linear(1, 1), object())
    delayed = delay_before_reduction(adapter, lambda: None)
    with pytest.raises(UnsupportedFeatureError, match="comm_trace"), delayed:
        pass


def test_canonical_states_and_transitions():
    assert [state.value for state in InstanceState] == [
        "IDLE",
        "FORWARD",
        "BACKWARD_PRE",
        "BACKWARD_POST",
        "SUMMON_FULL_PARAMS",
    ]
    assert [state.value for state in RootState] == [
        "IDLE",
        "FORWARD_BACKWARD",
        "SUMMON_FULL_PARAMS",
    ]
    assert InstanceState.BACKWARD_PRE == "BACKWARD_PRE" and str(RootState.IDLE) == "IDLE"
    assert InstanceState.FORWARD in LEGAL_INSTANCE_TRANSITIONS[InstanceState.BACKWARD_PRE]  # AC
    assert InstanceState.BACKWARD_POST not in LEGAL_INSTANCE_TRANSITIONS[InstanceState.IDLE]
    assert set(LEGAL_INSTANCE_TRANSITIONS) == set(InstanceState)
    assert set(LEGAL_ROOT_TRANSITIONS) == set(RootState)


def test_fsdp2_state_mapping_covers_every_fsdp2_state():
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    from fsdp_conformance.adapters.torch_fsdp2 import _RENAMED_STATES

    # KeyError: a new one
    mapped = {s: InstanceState[_RENAMED_STATES.get(s.name, s.name)] for s in TrainingState}
    assert set(mapped.values()) == {
        InstanceState.IDLE,
        InstanceState.FORWARD,
        InstanceState.BACKWARD_PRE,
        InstanceState.BACKWARD_POST,
    }


def test_fsdp1_state_names_map_onto_canonical_names():
    from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState

    assert {state.name for state in HandleTrainingState} == {state.value for state in InstanceState}
    assert {state.name for state in TrainingState} == {state.value for state in RootState}


def test_wrapper_validates_early_and_merges_overrides():
    calls = []

    class Recording(Adapter):
        name = "recording"
        declarations = Declarations(unsupported={Feature.CPU_OFFLOAD: "no offload here"})

        def _wrap(self, module, process_group, config):
            calls.append((process_group, config))
            return module

    adapter = Recording()
    with pytest.raises(UnsupportedFeatureError, match="'recording' does not support 'cpu_offload'"):
        adapter.wrapper(cpu_offload=True)
    group, other = object(), object()
    wrap = adapter.wrapper(process_group=group, sharding_strategy="shard_grad_op")
    wrap(nn.Linear(1, 1))
    wrap(nn.Linear(1, 1), process_group=other, forward_prefetch=True)
    assert calls == [
        (group, {"sharding_strategy": "SHARD_GRAD_OP"}),
        (other, {"sharding_strategy": "SHARD_GRAD_OP", "forward_prefetch": True}),
    ]
