"""The conformance suite: pytest test classes any FSDP implementation can run.

Run it against an adapter::

    pytest --pyargs fsdp_conformance.suite --fsdp-impl mypkg.fsdp_adapter:ADAPTER

or subclass the base classes in your own tests (the pandas ``tests/extension/base`` pattern)::

    from fsdp_conformance.suite import BaseDDPParityTests

    class TestParity(BaseDDPParityTests):
        pass

See docs/suite.md. The base classes are not named ``Test*``, so importing them does not
collect them twice.
"""

from __future__ import annotations

from .comm_checks import BaseCollectiveCountTests, BasePrefetchOrderTests
from .generated import BaseGeneratedModelTests
from .loops import (
    BaseActivationCheckpointingTests,
    BaseCheckpointResumeTests,
    BaseForwardVariantsTests,
    BaseFrozenParameterTests,
    BaseGradientAccumulationTests,
    BaseGradientClippingTests,
)
from .memory_bound import BaseMemoryBoundTests
from .misuse import BaseBadInputTests, BaseExecOrderTests
from .overlap import BaseOverlapTests
from .parity import BaseDDPParityTests, BaseStateDictTests, BaseSummonFullParamsTests
from .states import BaseTrainingStateTests
from .test_forward import BaseForwardMethodTests
from .test_init import BaseMetaInitTests
from .test_memory import BaseReshardAfterForwardTests
from .test_optim import BaseParamGroupTests
from .test_precision import BasePrecisionTests
from .test_sharding import BaseHybridShardingTests, BaseUnevenShardingTests
from .test_state_dict import BaseFullStateDictTests
from .test_wrap import BaseSharedParamsTests
from .test_wrap_isolation import BaseConfigIsolationTests

__all__ = [
    "BaseActivationCheckpointingTests",
    "BaseBadInputTests",
    "BaseCheckpointResumeTests",
    "BaseCollectiveCountTests",
    "BaseConfigIsolationTests",
    "BaseDDPParityTests",
    "BaseExecOrderTests",
    "BaseForwardVariantsTests",
    "BaseForwardMethodTests",
    "BaseFrozenParameterTests",
    "BaseFullStateDictTests",
    "BaseGeneratedModelTests",
    "BaseGradientAccumulationTests",
    "BaseGradientClippingTests",
    "BaseHybridShardingTests",
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
