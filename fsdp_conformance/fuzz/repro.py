"""``fsdp_conformance.suite.fuzz.repro`` under its old name (``repro.py`` files import it)."""

from __future__ import annotations

from fsdp_conformance.suite.fuzz.repro import *
from fsdp_conformance.suite.fuzz.repro import main, repro_source, write_repro  # noqa: F401
