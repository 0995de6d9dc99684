"""``fsdp_conformance.suite.fuzz.spec`` under its old name (``repro.py`` files import it)."""

from __future__ import annotations

from fsdp_conformance.suite.fuzz.spec import *
from fsdp_conformance.suite.fuzz.spec import (  # noqa: F401
    Block,
    FuzzCase,
    ModelSpec,
    Program,
    Seq,
    Step,
)
