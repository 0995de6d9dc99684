"""Without fairscale, ``--fsdp-impl fairscale`` is refused at configure with the install line
(tests/cli/test_refusals.py); an adapter resolved in the ranks alone (a suite class whose
``fsdp_impl`` fixture names fairscale) skips every cell with that line.

fairscale is hidden from a fresh pytest process and its rank processes by a package of the same
name, first on PYTHONPATH, that raises ModuleNotFoundError as a missing package does.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

INSTALL = "pip install 'fsdp-conformance[fairscale]'"
# one cell of each kind of check: parity, summon, states, memory bound, misuse, collectives
SELECTED = (
    "test_state_dict_round_trip or test_summon_full_params or test_assert_state"
    " or test_unlimited_all_gathers or test_wrapping_a_module_twice"
    " or test_divergent_exec_order or test_counts_per_phase"
)
SUITE_ON_FAIRSCALE = """
import pytest

from fsdp_conformance.suite import (
    BaseBadInputTests, BaseCollectiveCountTests, BaseExecOrderTests, BaseMemoryBoundTests,
    BaseStateDictTests, BaseSummonFullParamsTests, BaseTrainingStateTests,
)


@pytest.fixture(scope="session")
def fsdp_impl():
    return "fairscale"


class TestBadInput(BaseBadInputTests): pass
class TestCounts(BaseCollectiveCountTests): pass
class TestExecOrder(BaseExecOrderTests): pass
class TestMemoryBound(BaseMemoryBoundTests): pass
class TestStateDict(BaseStateDictTests): pass
class TestSummon(BaseSummonFullParamsTests): pass
class TestStates(BaseTrainingStateTests): pass
"""


def test_every_fairscale_cell_skips_with_the_install_line(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    hidden = pytester.path / "hidden"
    (hidden / "fairscale").mkdir(parents=True)
    (hidden / "fairscale" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'fairscale'\", name='fairscale')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(hidden))
    pytester.makepyfile(test_suite_on_fairscale=SUITE_ON_FAIRSCALE)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rs", "-n", "0", "test_suite_on_fairscale.py", "-k", SELECTED,
    )  # fmt: skip
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) >= 7, result.stdout.str()
    assert set(outcomes) <= {"skipped", "deselected", "warnings", "warning"}, result.stdout.str()
    skip_lines = [line for line in result.stdout.lines if line.startswith("SKIPPED")]
    assert skip_lines, result.stdout.str()
    for line in skip_lines:
        assert "adapter 'fairscale'" in line and INSTALL in line, line
