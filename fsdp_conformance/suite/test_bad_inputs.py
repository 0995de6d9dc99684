"""Bad inputs raise clear errors within seconds (collected by ``--pyargs``)."""

from __future__ import annotations

from fsdp_conformance.suite.misuse import BaseBadInputTests


class TestBadInputs(BaseBadInputTests):
    pass
