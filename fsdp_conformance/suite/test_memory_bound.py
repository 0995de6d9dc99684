"""The two-instance memory bound of limit_all_gathers (``memory_bound*``; [Note: memory bound]
in memory_bound.py). A subclass may run fewer lagging-device variants (``lag_variants``)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from fsdp_conformance.adapters import Adapter
from fsdp_conformance.observe.lagging import LAG_VARIANTS

from . import memory_bound
from .declare import check
from .memory_bound import OWN_BOUNDS, BoundCase
from .stream_bound import StreamOrderedBound


class BaseMemoryBoundTests:
    """Resident unsharded buffers stay within the bound, at world size 2 on a ``ChainOfLinears``."""

    lag_variants: ClassVar[tuple[str, ...]] = LAG_VARIANTS
    # adapter name -> its own bound (stream-ordered implementations)
    own_bounds: ClassVar[dict[str, StreamOrderedBound]] = OWN_BOUNDS

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "known_deviations" in cls.__dict__:
            raise TypeError(
                f"{cls.__name__}.known_deviations: the suite class no longer takes deviations; "
                "declare them on the adapter instead (Declarations(known_deviations=(Deviation("
                "'memory_bound', reason, applies=lambda case: ...),)), docs/adapters.md)"
            )

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        lags = self.lag_variants
        cases = {
            "bound_case": memory_bound.limited_cases(lags),
            "unlimited_case": [BoundCase(lag, limit_all_gathers=False) for lag in lags],
            "cuda_case": [BoundCase("cuda"), BoundCase("cuda", limit_all_gathers=False)],
            "shard_grad_op_case": [BoundCase(lag, "SHARD_GRAD_OP", "BACKWARD_PRE") for lag in lags],
        }
        for name, values in cases.items():
            if name in metafunc.fixturenames:
                metafunc.parametrize(name, [case.param() for case in values])

    def _measure(self, adapter: Adapter, dist: Any, case: BoundCase) -> Any:
        return memory_bound.measure_residency(adapter, dist.group, case.wrap_config, case.lag)

    @check(
        "memory_bound",
        "two-instance memory bound of limit_all_gathers (or the implementation's own bound)",
        case="memory_bound.BoundCase",
        case_of="bound_case",
    )
    def test_limited_all_gathers_stay_within_bound(
        self, fsdp_adapter: Adapter, dist: Any, bound_case: BoundCase
    ) -> None:
        tracker = self._measure(fsdp_adapter, dist, bound_case)
        own_bound = memory_bound.own_bound_of(fsdp_adapter, self.own_bounds)
        memory_bound.check_residency(
            tracker, bound_case, f"adapter {fsdp_adapter.name!r}", own_bound
        )

    @check(
        "memory_bound.unlimited",
        "without the limiter the lagging device keeps every all-gather resident (the bound check "
        "can fail)",
        features=("limit_all_gathers_off",),
        case="memory_bound.BoundCase",
        case_of="unlimited_case",
        api=("FullyShardedDataParallel(limit_all_gathers=False)",),
    )
    def test_unlimited_all_gathers_exceed_bound(
        self, fsdp_adapter: Adapter, dist: Any, unlimited_case: BoundCase
    ) -> None:
        # the check can fail: without the limiter every all-gather stays resident
        tracker = self._measure(fsdp_adapter, dist, unlimited_case)
        with pytest.raises(AssertionError, match="memory bound exceeded") as failure:
            memory_bound.check_residency(tracker, unlimited_case, f"adapter {fsdp_adapter.name!r}")
        assert f"iteration 1 forward: peak {memory_bound.LAYERS} " in str(failure.value), str(
            failure.value
        )

    @check("memory_bound", case_of="shard_grad_op_case")
    def test_shard_grad_op_keeps_backward_within_bound(
        self, fsdp_adapter: Adapter, dist: Any, shard_grad_op_case: BoundCase
    ) -> None:
        tracker = self._measure(fsdp_adapter, dist, shard_grad_op_case)
        own_bound = memory_bound.own_bound_of(fsdp_adapter, self.own_bounds)
        label = f"adapter {fsdp_adapter.name!r}"
        # forward is exempt from the bound: SHARD_GRAD_OP keeps every buffer until backward
        memory_bound.check_shard_grad_op_forward(tracker, shard_grad_op_case, label, own_bound)
        memory_bound.check_residency(tracker, shard_grad_op_case, label, own_bound)

    @check(
        "memory_bound.cuda",
        "the CUDA caching allocator's forward peaks respect the bound (GPU)",
        case="memory_bound.BoundCase",
        case_of="cuda_case",
    )
    @pytest.mark.cuda
    def test_cuda_allocator_peak_within_bound(
        self, fsdp_adapter: Adapter, dist: Any, cuda_case: BoundCase
    ) -> None:
        if dist.device.type != "cuda":
            pytest.skip(
                "CUDA variant of the memory-bound check: needs a GPU (one per rank, or one the "
                f"ranks share; they run on {dist.device}); the CPU variant with the lagging "
                "device covers the bound"
            )
        measured = memory_bound.measure_cuda_forward_peaks(
            fsdp_adapter, dist.group, dist.device, cuda_case.wrap_config
        )
        label = f"adapter {fsdp_adapter.name!r}"
        if cuda_case.limit_all_gathers:
            memory_bound.check_cuda_forward_peaks(measured, cuda_case, label)
        else:
            with pytest.raises(AssertionError, match="memory bound exceeded"):
                memory_bound.check_cuda_forward_peaks(measured, cuda_case, label)


class TestMemoryBound(BaseMemoryBoundTests):
    pass
