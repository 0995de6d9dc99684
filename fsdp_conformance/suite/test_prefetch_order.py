"""The prefetch order and "prefetch actually happens" (``comm.prefetch_*``) on traces of
``comm_checks.trace_training`` ([Note: prefetch happens] in comm_checks.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as tdist

from fsdp_conformance.observe.comm_trace import CommTrace

from . import comm_checks, prefetch_goldens
from .declare import check

_PREFETCH_CASES = pytest.mark.parametrize(
    ("model_name", "backward_prefetch", "forward_prefetch"), comm_checks.prefetch_params()
)


def _traced(
    adapter: Any, dist: Any, model_name: str, *prefetch: Any
) -> tuple[dict[str, Any], CommTrace, str]:
    """The config, the trace of ``comm_checks.trace_training`` and a label naming both."""
    config = comm_checks.prefetch_config(*prefetch)
    trace, _ = comm_checks.trace_training(adapter, model_name, dist, config)
    label = f"adapter {adapter.name!r}, {model_name}, {comm_checks.describe_config(config)}"
    return config, trace, label


class BasePrefetchOrderTests:
    """Prefetch-order goldens and "prefetch actually happens" (FULL_SHARD, 3 iterations).

    ``test_trace_matches_golden`` compares the rendered trace with the adapter's golden
    (``prefetch_goldens.py``: ``impl`` and the torch adapters); other adapters skip, or override
    ``check_golden`` with their own goldens."""

    def check_golden(self, adapter_name: str, case: str, rendered: str) -> str | None:
        """Compare ``rendered`` with the golden of ``adapter_name`` / ``case`` (or skip);
        returns "recorded on torch X, matches on torch Y" for a golden of another release."""
        return prefetch_goldens.check_golden(adapter_name, case, rendered)

    @pytest.mark.world_size(2)
    @_PREFETCH_CASES
    @check(
        "comm.prefetch_happens",
        "configured prefetches happen",
        features=("comm_trace",),
        case="the wrap config dict",
        case_of=comm_checks.prefetch_config,
        api=(
            "FullyShardedDataParallel(backward_prefetch)",
            "BackwardPrefetch.BACKWARD_PRE",
            "BackwardPrefetch.BACKWARD_POST",
            "FullyShardedDataParallel(forward_prefetch=True)",
        ),
    )
    def test_prefetch_happens(
        self, fsdp_adapter, dist, model_name, backward_prefetch, forward_prefetch
    ):
        config, trace, label = _traced(
            fsdp_adapter, dist, model_name, backward_prefetch, forward_prefetch
        )
        comm_checks.assert_prefetch_happens(trace, config, label)

    @pytest.mark.world_size(2)
    @_PREFETCH_CASES
    @check(
        "comm.prefetch_golden",
        "the prefetch order matches the recorded golden",
        features=("comm_trace",),
        case="the golden case name",
        case_of=comm_checks.prefetch_case_id,
        api=("FullyShardedDataParallel(backward_prefetch=None)",),
    )
    def test_trace_matches_golden(
        self, fsdp_adapter, dist, model_name, backward_prefetch, forward_prefetch
    ):
        _, trace, label = _traced(
            fsdp_adapter, dist, model_name, backward_prefetch, forward_prefetch
        )
        rendered = trace.render(ops=None)
        renders: list[Any] = [None] * dist.world_size
        tdist.all_gather_object(renders, rendered, group=dist.group)
        differing = [rank for rank, other in enumerate(renders) if other != renders[0]]
        assert not differing, (
            f"{label}: the trace of rank(s) {differing} differs from rank 0's (labels or order "
            f"are not stable across ranks):\nrank 0:\n{renders[0]}\nrank {differing[0]}:\n"
            f"{renders[differing[0]]}"
        )
        if prefetch_goldens.accepting() and dist.rank != 0:
            return  # accept on rank 0 only: one writer per golden
        self.check_golden(
            fsdp_adapter.name,
            comm_checks.prefetch_case_id(model_name, backward_prefetch, forward_prefetch),
            rendered,
        )


class TestPrefetchOrder(BasePrefetchOrderTests): ...
