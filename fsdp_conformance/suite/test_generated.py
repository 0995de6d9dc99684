"""Generated models and training programs vs DDP (collected by ``--pyargs``; docs/fuzz.md)."""

from __future__ import annotations

from fsdp_conformance.suite.generated import BaseGeneratedModelTests


class TestGeneratedModels(BaseGeneratedModelTests):
    pass
