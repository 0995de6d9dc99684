"""pytest plugin of fsdp-conformance (registered through the ``pytest11`` entry point).

Import-light: torch is imported only inside hooks and fixtures.
"""
from __future__ import annotations
