"""Divergent execution order across ranks (collected by ``--pyargs``)."""

from __future__ import annotations

from fsdp_conformance.suite.misuse import BaseExecOrderTests


class TestExecOrder(BaseExecOrderTests):
    pass
