"""Collective counts per phase (collected by ``--pyargs``)."""

from __future__ import annotations

from fsdp_conformance.suite.comm_checks import BaseCollectiveCountTests


class TestCollectiveCounts(BaseCollectiveCountTests):
    pass
