"""The training loops around the wrapper (collected by ``--pyargs``): gradient accumulation,
clipping, frozen parameters, activation checkpointing, forward variants, checkpoint/resume."""

from __future__ import annotations

from fsdp_conformance.suite.loops import (
    BaseActivationCheckpointingTests,
    BaseCheckpointResumeTests,
    BaseForwardVariantsTests,
    BaseFrozenParameterTests,
    BaseGradientAccumulationTests,
    BaseGradientClippingTests,
)


class TestGradientAccumulation(BaseGradientAccumulationTests):
    pass


class TestGradientClipping(BaseGradientClippingTests):
    pass


class TestFrozenParameters(BaseFrozenParameterTests):
    pass


class TestActivationCheckpointing(BaseActivationCheckpointingTests):
    pass


class TestForwardVariants(BaseForwardVariantsTests):
    pass


class TestCheckpointResume(BaseCheckpointResumeTests):
    pass
