"""fsdp-conformance: a conformance suite for FSDP implementations.

Importing this package does not import torch; the public names below are
resolved on first access so that the pytest plugin stays import-light.
"""
from __future__ import annotations

__all__: list[str] = []
