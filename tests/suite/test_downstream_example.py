"""The downstream-style example (examples/) runs the suite against its own adapter.

examples/my_fsdp_adapter.py is the adapter example of docs/adapters.md (checked identical here,
so the two never drift); examples/test_my_fsdp.py subclasses the suite's base classes. Both
routes are run in a fresh pytest process: ``--pyargs fsdp_conformance.suite --fsdp-impl
my_fsdp_adapter:ADAPTER`` and the subclassing test module.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SKIP_REASON = "*adapter 'my-fsdp' does not support '*': not wired up in my-fsdp yet"


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


def test_pyargs_run_with_module_attr_adapter(pytester: pytest.Pytester) -> None:
    _copy_examples(pytester)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rs",
        "--pyargs", "fsdp_conformance.suite.test_parity",
        "fsdp_conformance.suite.test_training_states",
        "--fsdp-impl", "my_fsdp_adapter:ADAPTER",
        "--fsdp-coverage", "pairwise",
        "-k", "nested and not delay and (ws2 or summon or state_dict or assert_state)",
    )  # fmt: skip
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("errors", 0) == 0, result.stdout.str()
    # summon without writeback, the state dict round trip through the adapter and the default
    # state_dict() check run; the rest needs features my-fsdp does not claim
    assert outcomes.get("passed") == 3, outcomes
    result.stdout.fnmatch_lines([SKIP_REASON])


def test_subclassing_module(pytester: pytest.Pytester) -> None:
    _copy_examples(pytester)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs", "test_my_fsdp.py")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("errors", 0) == 0, result.stdout.str()
    # summon, the state dict round trip and the default state_dict() check, two models each
    assert outcomes.get("passed") == 6, outcomes
    result.stdout.fnmatch_lines([SKIP_REASON])
