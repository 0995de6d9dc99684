"""Prefetch order goldens and "prefetch actually happens" (collected by ``--pyargs``)."""

from __future__ import annotations

from fsdp_conformance.suite.comm_checks import BasePrefetchOrderTests


class TestPrefetchOrder(BasePrefetchOrderTests):
    pass
