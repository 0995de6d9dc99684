"""The precision checks (suite/test_precision.py) against the built-in adapters: impl, torch
FSDP1 and torch FSDP2 run every cell (FSDP1's no_sync accumulation is its declared deviation);
fairscale runs its float16 policy when installed (its bfloat16 cells are its declared
deviation; its grad scaler cell is not applicable on a CPU-only host)."""

from __future__ import annotations

import pytest

from fsdp_conformance.suite import BasePrecisionTests


@pytest.fixture(params=("impl", "torch-fsdp1", "torch-fsdp2"))
def fsdp_impl(request: pytest.FixtureRequest) -> str:
    return request.param


class TestPrecision(BasePrecisionTests):
    pass


class TestPrecisionFairscale(BasePrecisionTests):
    policies = ("fp16-reduce-fp32",)
    accumulations = ()

    @pytest.fixture
    def fsdp_impl(self) -> str:
        pytest.importorskip("fairscale")
        return "fairscale"


def test_mixed_precision_vocabulary():
    """FSDP2's policy fields enter the mixed_precision key; beyond one low-precision dtype a
    config needs mixed_precision_policy; bad values are refused naming the field."""
    import torch

    from fsdp_conformance.adapters import Feature
    from fsdp_conformance.adapters.features import features_for, normalize_config

    def needs(**mixed):
        return features_for(normalize_config({"mixed_precision": mixed}))

    bf16, fp32 = torch.bfloat16, torch.float32
    assert Feature.MIXED_PRECISION_POLICY not in needs(param_dtype=bf16, reduce_dtype=bf16)
    assert Feature.MIXED_PRECISION_POLICY in needs(param_dtype=bf16, reduce_dtype=fp32)
    assert Feature.MIXED_PRECISION_POLICY in needs(param_dtype=bf16, output_dtype=fp32)
    assert Feature.MIXED_PRECISION_POLICY in needs(param_dtype=bf16, cast_forward_inputs=False)
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    fsdp1 = normalize_config({"mixed_precision": MixedPrecision(param_dtype=bf16)})
    assert fsdp1["mixed_precision"].cast_forward_inputs is None  # FSDP1's default: root casts
    policy = MixedPrecisionPolicy(param_dtype=bf16, output_dtype=fp32)
    fsdp2 = normalize_config({"mixed_precision": policy})["mixed_precision"]
    assert (fsdp2.output_dtype, fsdp2.cast_forward_inputs) == (fp32, True)
    with pytest.raises(TypeError, match="output_dtype=torch.int64"):
        needs(output_dtype=torch.int64)
    with pytest.raises(TypeError, match=r"keys \['keep_low_precision_grads'\]"):
        needs(keep_low_precision_grads=True)
