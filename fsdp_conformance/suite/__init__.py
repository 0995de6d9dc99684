"""The conformance suite: pytest base classes any FSDP implementation can run, with
``pytest --pyargs fsdp_conformance.suite --fsdp-impl mypkg.fsdp_adapter:ADAPTER`` or by
subclassing them in your own tests (``class TestParity(BaseDDPParityTests): pass``;
docs/suite.md). The base classes are not named ``Test*``, so importing them does not collect
them twice.
"""

from __future__ import annotations

# importing the families declares their checks in this order, the registry's (docs/checks.md)
# isort: off
from .declare import check as check  # the decorator declaring a check (docs/checks.md)
from .test_parity import BaseDDPParityTests, BaseStateDictTests, BaseSummonFullParamsTests
from .test_training_states import BaseTrainingStateTests
from .test_memory_bound import BaseMemoryBoundTests
from .test_collectives import BaseCollectiveCountTests
from .test_prefetch_order import BasePrefetchOrderTests
from .test_overlap import BaseOverlapTests
from .test_exec_order import BaseExecOrderTests
from .test_bad_inputs import BaseBadInputTests
from .test_loops import (
    BaseActivationCheckpointingTests,
    BaseCheckpointResumeTests,
    BaseForwardVariantsTests,
    BaseFrozenParameterTests,
    BaseGradientAccumulationTests,
    BaseGradientClippingTests,
)
from .fuzz.test_generated import BaseGeneratedModelTests
from .test_precision import BasePrecisionTests
from .test_state_dict import BaseFullStateDictTests
from .test_init import BaseMetaInitTests
from .test_sharding import BaseHybridShardingTests, BaseUnevenShardingTests
from .test_wrap import BaseIgnoredParamsTests, BaseSharedParamsTests
from .test_optim import BaseParamGroupTests
from .test_forward import BaseForwardMethodTests
from .test_memory import BaseReshardAfterForwardTests
from .test_wrap_isolation import BaseConfigIsolationTests
from .test_fsdp1_constructor import BaseFSDP1ConstructorTests
from .test_fsdp2_api import BaseFSDP2APITests
from .test_fsdp2_module import BaseFSDP2ModuleTests
from .test_fsdp1_methods import BaseFSDP1MethodTests
# isort: on

__all__ = [
    "BaseActivationCheckpointingTests",
    "BaseBadInputTests",
    "BaseCheckpointResumeTests",
    "BaseCollectiveCountTests",
    "BaseConfigIsolationTests",
    "BaseDDPParityTests",
    "BaseExecOrderTests",
    "BaseFSDP1ConstructorTests",
    "BaseFSDP1MethodTests",
    "BaseFSDP2APITests",
    "BaseFSDP2ModuleTests",
    "BaseForwardMethodTests",
    "BaseForwardVariantsTests",
    "BaseFrozenParameterTests",
    "BaseFullStateDictTests",
    "BaseGeneratedModelTests",
    "BaseGradientAccumulationTests",
    "BaseGradientClippingTests",
    "BaseHybridShardingTests",
    "BaseIgnoredParamsTests",
    "BaseMemoryBoundTests",
    "BaseMetaInitTests",
    "BaseOverlapTests",
    "BaseParamGroupTests",
    "BasePrecisionTests",
    "BasePrefetchOrderTests",
    "BaseReshardAfterForwardTests",
    "BaseSharedParamsTests",
    "BaseStateDictTests",
    "BaseSummonFullParamsTests",
    "BaseTrainingStateTests",
    "BaseUnevenShardingTests",
]
