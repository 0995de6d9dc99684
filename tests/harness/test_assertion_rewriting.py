"""Every rank runs rewritten asserts: a bare ``assert a == b`` in a user's ``dist`` test shows
both values in each rank's report, also when the rank had imported the test module plainly
first, and the suite's own modules are the rewritten copies in every rank."""

from __future__ import annotations

import pytest

from conftest import write_test

pytest_plugins = ["pytester"]

HELPER = """
def test_plain_in_rank(dist):
    left = [1, dist.rank, 3]
    assert left == [1, dist.rank + 10, 3]
"""

USER = """
import pytest

import test_imported_plainly  # a rank imports it plainly while loading this module


def test_bare_assert(dist):
    seen = {"rank": dist.rank, "steps": [0.5, 0.25]}
    assert seen == {"rank": dist.rank, "steps": [0.5, 0.125]}


def test_suite_modules_are_rewritten(dist):
    import fsdp_conformance.suite.test_parity as parity

    assert "@pytest_ar" in vars(parity), "the suite's test module was imported plainly"
"""


@pytest.mark.parametrize("mode", ["process"])
def test_bare_asserts_explain_themselves_in_every_rank(pytester, mode):
    write_test(pytester, "test_imported_plainly", HELPER)
    write_test(pytester, "test_user", USER)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", f"--fsdp-mode={mode}", "test_user.py", "test_imported_plainly.py"
    )
    result.assert_outcomes(passed=1, failed=2)
    text = result.stdout.str()
    for rank in (0, 1):
        assert f"rank {rank} of 2 failed: AssertionError: assert [1, {rank}, 3] == [1, " in text
        assert f"rank {rank} of 2 failed: AssertionError: assert {{'rank': {rank}, '" in text
    assert "{'steps': [0.5, 0.25]} != {'steps': [0.5, 0.125]}" in text, text
