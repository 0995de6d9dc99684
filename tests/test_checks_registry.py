"""The check registry (fsdp_conformance/checks.py) and the suite keep in step, both ways."""

from __future__ import annotations

import inspect

import pytest

from fsdp_conformance import checks


def suite_base_classes(module) -> dict[str, type]:
    """Name -> class of every base class a suite module exports (``Base*``)."""
    return {
        name: value
        for name, value in vars(module).items()
        if inspect.isclass(value) and name.startswith("Base")
    }


def registry_problems(registry: dict[str, checks.Check], bases: dict[str, type]) -> list[str]:
    """Registered tests missing from the suite, and suite tests no check registers."""
    problems = []
    registered = set()
    for check in registry.values():
        for test in check.tests:
            registered.add(test)
            class_name, _, method = test.rpartition(".")
            base = bases.get(class_name)
            if base is None or not callable(getattr(base, method, None)):
                problems.append(f"check {check.id!r} names {test}, which the suite lacks")
    for name, base in bases.items():
        for method in dir(base):
            if method.startswith("test_") and f"{name}.{method}" not in registered:
                owner = next(k.__name__ for k in base.__mro__ if method in vars(k))
                if f"{owner}.{method}" not in registered:
                    problems.append(f"suite test {name}.{method} is registered by no check")
    return problems


def test_every_registered_check_is_in_the_suite_and_the_reverse():
    from fsdp_conformance import suite

    bases = suite_base_classes(suite)
    assert len(bases) >= 10  # the walk found the suite
    assert registry_problems(checks.CHECKS, bases) == []


class _FakeBase:
    def test_registered(self):
        pass

    def test_forgotten(self):
        pass


def test_a_check_missing_from_the_suite_or_the_reverse_is_reported():
    registry = {
        "a": checks.Check("a", "registered and present", ("_FakeBase.test_registered",)),
        "b": checks.Check("b", "registered, no such test", ("_FakeBase.test_gone",)),
    }
    problems = registry_problems(registry, {"_FakeBase": _FakeBase})
    assert problems == [
        "check 'b' names _FakeBase.test_gone, which the suite lacks",
        "suite test _FakeBase.test_forgotten is registered by no check",
    ]


def test_ids_are_unique_and_lookups_explain_themselves():
    assert len(checks.CHECKS) == len({check.id for check in checks.CHECKS.values()})
    with pytest.raises(ValueError, match="unknown check id 'nope'; use one of .*parity.ddp"):
        checks.get_check("nope")
    found = checks.check_for_test(
        ["TestBadInputs", "BaseBadInputTests"], "test_wrapping_a_module_twice"
    )
    assert found is not None and found.id == "misuse.wrap_twice"
    assert checks.check_for_test(["Other"], "test_wrapping_a_module_twice") is None


def test_the_old_check_ids_name_is_the_registry():
    from fsdp_conformance.adapters import CHECK_IDS

    assert CHECK_IDS == {check.id: check.description for check in checks.CHECKS.values()}


@pytest.mark.parametrize(
    ("outcome", "xfail", "recorded", "expected"),
    [
        ("passed", False, {"fsdp_verdict": "pass"}, ("pass", "")),
        ("failed", False, {"fsdp_verdict": "deviation", "fsdp_reason": "r"}, ("FAIL", "boom")),
        (
            "skipped",
            True,
            {"fsdp_verdict": "deviation", "fsdp_reason": "why"},
            ("deviation", "why"),
        ),
        ("skipped", False, {}, ("not applicable", "boom")),
        ("passed", True, {}, ("FAIL", "unexpectedly passed: boom")),
    ],
)
def test_verdict_of_outcome_prefers_pytests_outcome(outcome, xfail, recorded, expected):
    assert checks.verdict_of_outcome(outcome, xfail, recorded, "boom") == expected


def test_docs_checks_md_holds_the_registry_table():
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "checks.md").read_text()
    begin, end = "<!-- registry:begin -->\n", "\n<!-- registry:end -->"
    assert begin in doc and end in doc, "docs/checks.md lost its registry markers"
    copy = doc.split(begin, 1)[1].split(end, 1)[0]
    assert copy == checks.registry_table(), (
        "docs/checks.md's registry table is stale; regenerate it with "
        "checks.registry_table() (see the section 'The check registry')"
    )
