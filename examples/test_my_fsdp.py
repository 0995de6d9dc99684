"""A downstream project's tests: the whole conformance suite against its own FSDP, by subclassing.

Next to my_fsdp_adapter.py (the tutorial adapter of docs/adapters.md). Run from this folder:

    pytest test_my_fsdp.py -n 2            # every check of the suite (pytest-xdist optional)
    pytest test_my_fsdp.py -k "Parity and nested"

The checks of ``fsdp-conformance run --impl my_fsdp_adapter:ADAPTER``: what the adapter does not
claim skips with "adapter 'my-fsdp' does not support '<feature>': not wired up in my-fsdp yet",
torch FSDP1's declared deviations are expected failures. (The parity configs are collected
over the values of ``--fsdp-impl``, the reference FSDP's unless given, so a few cells more are
collected here than by ``run``, and skip.)
"""

from __future__ import annotations

import pytest

from fsdp_conformance import suite


@pytest.fixture
def fsdp_impl() -> str:
    """Every suite class in this module drives my_fsdp_adapter.ADAPTER."""
    return "my_fsdp_adapter:ADAPTER"


class TestParity(suite.BaseDDPParityTests):
    coverage = "pairwise"  # every pair of config values, as `fsdp-conformance run` does


# every other check of the suite, unchanged (suite classes added later join by themselves)
for _name in suite.__all__:
    _test_name = "Test" + _name.removeprefix("Base").removesuffix("Tests")
    if _name.startswith("Base") and _name != "BaseDDPParityTests":
        globals()[_test_name] = type(_test_name, (getattr(suite, _name),), {})
