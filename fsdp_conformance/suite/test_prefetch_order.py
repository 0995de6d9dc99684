"""The prefetch order and "prefetch actually happens" (``comm.prefetch_*``): traces of
``comm_checks.trace_training`` ([Note: prefetch happens] in comm_checks.py).

    class TestMyPrefetchOrder(BasePrefetchOrderTests):   # pytest collects Test* classes
        pass
"""

from __future__ import annotations

from typing import Any

import pytest

from . import comm_checks
from .declare import check


class BasePrefetchOrderTests:
    """Prefetch order goldens and "prefetch actually happens" (FULL_SHARD, 3 iterations).

    ``test_prefetch_happens`` holds every adapter that supports a prefetch setting to it
    ([Note: prefetch happens]). ``test_trace_matches_golden`` compares the rendered trace
    (one event per line, labels = module paths in the unwrapped model) with the golden of the
    adapter (``check_golden``): the goldens are implementation-specific (the exact interleaving
    of all-gathers, frees, reductions and compute), shipped for ``impl`` and ``torch-fsdp1``
    (recorded on torch 2.13; compared on other releases with the nearest recorded one) as data
    files (``prefetch_goldens.py`` reads and accepts them); other
    adapters skip it -- override ``check_golden`` in a subclass with your own goldens.
    """

    def check_golden(self, adapter_name: str, case: str, rendered: str) -> str | None:
        """Compare ``rendered`` with the golden of ``adapter_name`` / ``case`` (or skip); the
        torch adapters' goldens travel to other torch releases ([Note: goldens that travel] in
        ``prefetch_goldens.py``): returns "recorded on torch X, matches on torch Y" then."""
        from . import prefetch_goldens

        return prefetch_goldens.check_golden(adapter_name, case, rendered)

    @pytest.mark.world_size(2)
    @pytest.mark.parametrize(
        ("model_name", "backward_prefetch", "forward_prefetch"), comm_checks.prefetch_params()
    )
    @check(
        "comm.prefetch_happens",
        "configured prefetches happen",
        features=("comm_trace",),
        case="the wrap config dict",
        case_of=comm_checks.prefetch_config,
    )
    def test_prefetch_happens(
        self,
        fsdp_adapter: Any,
        dist: Any,
        model_name: str,
        backward_prefetch: Any,
        forward_prefetch: bool,
    ):
        config = comm_checks.prefetch_config(backward_prefetch, forward_prefetch)
        trace, _ = comm_checks.trace_training(fsdp_adapter, model_name, dist, config)
        label = (
            f"adapter {fsdp_adapter.name!r}, {model_name}, {comm_checks.describe_config(config)}"
        )
        comm_checks.assert_prefetch_happens(trace, config, label)

    @pytest.mark.world_size(2)
    @pytest.mark.parametrize(
        ("model_name", "backward_prefetch", "forward_prefetch"), comm_checks.prefetch_params()
    )
    @check(
        "comm.prefetch_golden",
        "the prefetch order matches the recorded golden",
        features=("comm_trace",),
        case="the golden case name",
        case_of=comm_checks.prefetch_case_id,
    )
    def test_trace_matches_golden(
        self,
        fsdp_adapter: Any,
        dist: Any,
        model_name: str,
        backward_prefetch: Any,
        forward_prefetch: bool,
    ):
        import torch.distributed as tdist

        config = comm_checks.prefetch_config(backward_prefetch, forward_prefetch)
        trace, _ = comm_checks.trace_training(fsdp_adapter, model_name, dist, config)
        rendered = trace.render(ops=None)
        renders: list[Any] = [None] * dist.world_size
        tdist.all_gather_object(renders, rendered, group=dist.group)
        differing = [rank for rank, other in enumerate(renders) if other != renders[0]]
        assert not differing, (
            f"adapter {fsdp_adapter.name!r}, {model_name}, {comm_checks.describe_config(config)}: "
            "the trace of "
            f"rank(s) {differing} differs from rank 0's (labels or order are not stable across "
            f"ranks):\nrank 0:\n{renders[0]}\nrank {differing[0]}:\n{renders[differing[0]]}"
        )
        from . import prefetch_goldens

        if prefetch_goldens.accepting() and dist.rank != 0:
            return  # accept on rank 0 only: one writer per golden
        self.check_golden(
            fsdp_adapter.name,
            comm_checks.prefetch_case_id(model_name, backward_prefetch, forward_prefetch),
            rendered,
        )


class TestPrefetchOrder(BasePrefetchOrderTests):
    pass
