"""The downstream-style example (examples/) runs the suite against its own adapter.

examples/my_fsdp_adapter.py is the tutorial adapter of docs/adapters.md (checked identical here,
so the two never drift); examples/test_my_fsdp.py subclasses every base class of the suite, so
``pytest test_my_fsdp.py`` in examples/ is the whole suite. Here, in a fresh pytest process, a
representative subset of it: one cell each of DDP parity, training states, the memory bound
(within it, and torch FSDP1's declared deviation with prefetching), prefetch and misuse (a
declared deviation). The whole suite on the example: ``cd examples && fsdp-conformance run
--impl my_fsdp_adapter:ADAPTER`` (docs/adapters.md has the measured run).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# node -> the outcome the example must get (xfailed: a declared torch FSDP1 deviation)
SUBSET = {
    "TestParity::test_matches_ddp"
    "[nested-ws2-FULL_SHARD-bwd=BACKWARD_PRE-fwd=0-limit=default-offload=0-init=after]": "passed",
    "TestTrainingState::test_states_are_legal_at_every_hook"
    "[nested-ws2-FULL_SHARD-bwd=BACKWARD_PRE]": "passed",
    "TestMemoryBound::test_limited_all_gathers_stay_within_bound"
    "[strict-FULL_SHARD-bwd=None-fwd=0-limit=1]": "passed",
    "TestMemoryBound::test_limited_all_gathers_stay_within_bound"
    "[strict-FULL_SHARD-bwd=BACKWARD_PRE-fwd=0-limit=1]": "xfailed",
    "TestPrefetchOrder::test_prefetch_happens[nested-bwd=BACKWARD_PRE-fwd=1]": "passed",
    "TestBadInput::test_wrapping_a_module_twice": "xfailed",
}


def _docs_example() -> str:
    text = (ROOT / "docs" / "adapters.md").read_text()
    match = re.search(
        r"<!-- example: my_fsdp_adapter\.py -->\n```python\n(.*?)```", text, re.DOTALL
    )
    assert match, "docs/adapters.md lost its my_fsdp_adapter.py example block"
    return match.group(1)


def test_example_adapter_is_the_docs_example() -> None:
    assert (EXAMPLES / "my_fsdp_adapter.py").read_text() == _docs_example(), (
        "examples/my_fsdp_adapter.py and the example in docs/adapters.md differ; keep them equal"
    )


def _copy_examples(pytester: pytest.Pytester) -> None:
    for name in ("my_fsdp_adapter.py", "test_my_fsdp.py"):
        (pytester.path / name).write_text((EXAMPLES / name).read_text())


def test_subclassing_module_covers_the_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every base class of the suite is a test class of the example module."""
    import importlib

    from fsdp_conformance import suite

    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.delitem(sys.modules, "test_my_fsdp", raising=False)
    module = importlib.import_module("test_my_fsdp")
    monkeypatch.delitem(sys.modules, "test_my_fsdp")
    test_classes = [value for name, value in vars(module).items() if name.startswith("Test")]
    for name in suite.__all__:
        base = getattr(suite, name)
        assert any(issubclass(cls, base) for cls in test_classes), (
            f"{name} has no test class in examples/test_my_fsdp.py"
        )


def test_representative_subset_passes(pytester: pytest.Pytester) -> None:
    _copy_examples(pytester)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rsx", *(f"test_my_fsdp.py::{node}" for node in SUBSET)
    )
    outcomes = result.parseoutcomes()
    expected: dict[str, int] = {}
    for outcome in SUBSET.values():
        expected[outcome] = expected.get(outcome, 0) + 1
    assert {k: v for k, v in outcomes.items() if k != "warnings"} == expected, result.stdout.str()
    result.stdout.fnmatch_lines(["*known deviation of adapter 'my-fsdp' (memory_bound)*"])
