"""Communication/computation overlap (collected by ``--pyargs``)."""

from __future__ import annotations

from fsdp_conformance.suite.overlap import BaseOverlapTests


class TestOverlap(BaseOverlapTests):
    pass
