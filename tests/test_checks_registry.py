"""The check registry (fsdp_conformance/checks.py) and the suite keep in step, both ways; the
suite declares its checks where it writes them (``fsdp_conformance.suite.check``)."""

from __future__ import annotations

import inspect

import pytest

import fsdp_conformance.suite  # noqa: F401  (the suite declares the checks)
from fsdp_conformance import checks, constants
from fsdp_conformance.suite import check


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
    for declared in registry.values():
        for test in declared.tests:
            registered.add(test)
            class_name, _, method = test.rpartition(".")
            base = bases.get(class_name)
            if base is None or not callable(getattr(base, method, None)):
                problems.append(f"check {declared.id!r} names {test}, which the suite lacks")
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


def test_check_of_reads_the_check_from_the_test_function():
    from fsdp_conformance.suite import BaseBadInputTests, BaseMemoryBoundTests

    class TestBadInputs(BaseBadInputTests):
        pass

    found = checks.check_of(TestBadInputs.test_wrapping_a_module_twice)
    assert found is not None and found.id == "misuse.wrap_twice"
    assert found.tests == ("BaseBadInputTests.test_wrapping_a_module_twice",)
    bound = checks.check_of(BaseMemoryBoundTests.test_shard_grad_op_keeps_backward_within_bound)
    assert bound is checks.CHECKS["memory_bound"] and len(bound.tests) == 2
    assert checks.check_of(test_check_of_reads_the_check_from_the_test_function) is None


def test_the_decorator_refuses_what_it_cannot_register(monkeypatch):
    monkeypatch.setattr(checks, "CHECKS", dict(checks.CHECKS))

    class _Fake:
        def test_a(self, fsdp_adapter, dist, strategy):
            pass

    with pytest.raises(
        ValueError, match="'nope.first' .*is not declared yet; give its description"
    ):
        check("nope.first")(_Fake.test_a)
    with pytest.raises(ValueError, match="'parity.ddp' is declared twice, differently"):
        check("parity.ddp", "another promise")(_Fake.test_a)
    with pytest.raises(ValueError, match="options belong to its first declaration"):
        check("parity.ddp", strict=False)(_Fake.test_a)
    with pytest.raises(TypeError, match="case_of names \\['case'\\], which the test does not"):
        check("x.case", "promise", case_of="case")(_Fake.test_a)

    def test_without_adapter(self, dist):
        pass

    with pytest.raises(TypeError, match="takes the fsdp_adapter fixture"):
        check("x.adapter", "promise")(test_without_adapter)
    declared = check("x.ok", "promise", case_of=lambda strategy: strategy.lower())(_Fake.test_a)
    assert checks.check_of(declared).tests == (
        "test_the_decorator_refuses_what_it_cannot_register.<locals>._Fake.test_a",
    )
    assert inspect.signature(declared) == inspect.signature(_Fake.test_a)  # pytest's fixtures


def test_every_builtin_deviation_names_a_declared_check():
    from fsdp_conformance.adapters import get_adapter

    for name in constants.BUILTIN_ADAPTERS:  # the suite checks each when it matches deviations
        for deviation in get_adapter(name).declarations.known_deviations:
            assert deviation.check in checks.CHECKS, (name, deviation.check)


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


def test_an_empty_registry_says_which_import_fills_it(monkeypatch):
    """Before fsdp_conformance.suite is imported no check is registered: the error says so and
    names the import, not an empty list of ids."""
    monkeypatch.setattr(checks, "CHECKS", {})
    with pytest.raises(
        ValueError, match=r"no check is registered yet; import fsdp_conformance\.suite"
    ):
        checks.get_check("parity.ddp")


def test_a_rerun_line_carries_the_pythonpath_the_run_needed(monkeypatch, tmp_path):
    """Pasted into a fresh shell (no PYTHONPATH), the line still finds an adapter that the run
    imported through PYTHONPATH: it carries the path, made absolute."""
    import os
    import shlex
    import subprocess

    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "found_here.py").write_text("VALUE = 'found'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "adapters")
    line = checks.shell_line("found_here:ADAPTER", ["python", "-c", "import found_here"])
    assert line.startswith(f"cd {shlex.quote(str(tmp_path))} && PYTHONPATH=")
    assert f"PYTHONPATH={tmp_path / 'adapters'} python -c" in line, line
    fresh = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(["bash", "-c", line], cwd="/", env=fresh, check=False, timeout=60)
    assert done.returncode == 0, line
    monkeypatch.delenv("PYTHONPATH")
    assert "PYTHONPATH" not in checks.shell_line("impl", ["fsdp-conformance", "run"])
