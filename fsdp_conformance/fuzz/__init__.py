"""The fuzzer's old home, kept for code and ``repro.py`` files written before it moved: the
fuzzer is ``fsdp_conformance.suite.fuzz``."""

from __future__ import annotations

from fsdp_conformance.suite.fuzz import *
from fsdp_conformance.suite.fuzz import __all__  # noqa: F401
