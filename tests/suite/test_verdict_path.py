"""The one verdict path (suite/verdict.py): a declared deviation covers only the failure it
declares, a crash in that cell is a failure, a stale strict deviation fails, and the verdict
travels as report properties into JUnit."""

from __future__ import annotations

import textwrap
import xml.etree.ElementTree as ET

import pytest

pytest_plugins = ["pytester"]

_ADAPTERS = '''
import dataclasses

from fsdp_conformance.adapters import Deviation, Envelope
from fsdp_conformance.adapters.impl import ImplAdapter


class Crashing(ImplAdapter):
    """Declares the mixed-devices misuse as a deviation (silently accepted), but really crashes
    with an unrelated AttributeError there: the crash must be a failure."""

    name = "crashing"
    declarations = dataclasses.replace(
        ImplAdapter.declarations,
        known_deviations=(
            Deviation(
                "misuse.mixed_devices",
                "accepts cpu and meta parameters; reproduction: wrap(Sequential(cpu, meta))",
                envelope=Envelope("no error raised"),
                measured_on="torch 2.13.0",
            ),
        ),
    )

    def _wrap(self, module, process_group, config):
        if any(p.is_meta for p in module.parameters()):
            raise AttributeError("'FSDPState' object has no attribute '_fsdp_param_groups'")
        return super()._wrap(module, process_group, config)


class Accepting(Crashing):
    """Really accepts the misuse (no exception): the declared deviation covers it."""

    name = "accepting"

    def _wrap(self, module, process_group, config):
        if any(p.is_meta for p in module.parameters()):
            return module
        return ImplAdapter._wrap(self, module, process_group, config)


class Stale(ImplAdapter):
    """Declares a strict deviation of a check impl passes."""

    name = "stale"
    declarations = dataclasses.replace(
        ImplAdapter.declarations,
        known_deviations=(
            Deviation(
                "states.assert_state",
                "says it fails; it does not",
                raises=ValueError,
                match="not in that state",
            ),
        ),
    )
'''


def _run(pytester: pytest.Pytester, adapter: str, keyword: str) -> tuple[object, dict]:
    pytester.makepyfile(verdict_adapters=textwrap.dedent(_ADAPTERS))
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess(
        "--pyargs", "fsdp_conformance.suite", "-p", "no:cacheprovider", "-n", "0",
        f"--fsdp-impl=verdict_adapters:{adapter}", "-k", keyword, f"--junitxml={junit}",
    )  # fmt: skip
    properties = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        properties[case.get("name")] = {
            prop.get("name"): prop.get("value") for prop in case.iter("property")
        }
    return result, properties


def test_an_unrelated_crash_in_a_deviating_cell_is_a_failure(pytester: pytest.Pytester) -> None:
    result, properties = _run(pytester, "Crashing", "test_parameters_on_mixed_devices")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*AttributeError*_fsdp_param_groups*"])
    (props,) = properties.values()
    assert props["fsdp_check"] == "misuse.mixed_devices"
    assert props["fsdp_verdict"] == "FAIL"
    assert "AttributeError" in props["fsdp_reason"], props
    # the crash is the check's "an error that does not name the problem", not the declared one
    declared = "declared: no error raised; measured: an error that does not name the problem"
    assert f"{declared} (error AttributeError: " in props["fsdp_reason"], props
    assert "AttributeError: 'FSDPState'" in props["fsdp_measured"], props


def test_the_declared_failure_is_a_deviation_with_versions(pytester: pytest.Pytester) -> None:
    result, properties = _run(pytester, "Accepting", "test_parameters_on_mixed_devices")
    result.assert_outcomes(xfailed=1)
    (props,) = properties.values()
    assert props["fsdp_verdict"] == "deviation"
    reason = props["fsdp_reason"]
    assert reason.startswith("accepts cpu and meta parameters; reproduction"), reason
    assert "measured on torch 2.13.0; running torch " in reason, reason
    assert "no exception was raised" in props["fsdp_failure"], props
    assert props["fsdp_measured"] == '{"failure": "no error raised"}', props


def test_a_stale_strict_deviation_fails(pytester: pytest.Pytester) -> None:
    result, properties = _run(pytester, "Stale", "test_assert_state")
    result.assert_outcomes(failed=1)
    (props,) = properties.values()
    assert props["fsdp_verdict"] == "FAIL"
    assert "but the check passed: remove the Deviation" in props["fsdp_reason"], props


def test_a_deviation_names_the_failure_it_covers() -> None:
    from fsdp_conformance.adapters import Deviation, Envelope
    from fsdp_conformance.checks import CheckFailure

    deviation = Deviation("parity.ddp", "r", raises=(AssertionError,), match=r"differs")
    assert deviation.covers(AssertionError("parameter 'w' differs from DDP's"))
    assert not deviation.covers(AssertionError("shape (2,) != (3,)"))
    assert not deviation.covers(AttributeError("differs"))
    with pytest.raises(pytest.fail.Exception) as failed:
        pytest.fail("differs")
    assert deviation.covers(failed.value)  # pytest.fail is the check's own assertion
    # a check's own failure (a CheckFailure) is covered by an envelope only
    assert not deviation.covers(CheckFailure("'w' differs", "training differs from DDP's"))
    envelope = Deviation("parity.ddp", "r", envelope=Envelope("training differs from DDP's"))
    assert envelope.covers(CheckFailure("'w' differs", "training differs from DDP's"))
    assert not envelope.covers(AssertionError("'w' differs from DDP's"))
    from fsdp_conformance.adapters.deviations import find_deviation
    from fsdp_conformance.suite import verdict  # noqa: F401  (the suite declares the checks)

    unknown = Deviation("parity.nope", "r", envelope=Envelope("x"))  # checked when matched
    with pytest.raises(ValueError, match=r"Deviation\(check='parity.nope'\): unknown check id"):
        find_deviation((unknown,), "parity.ddp")


_UNTRACED = '''
import dataclasses
import os
import pathlib

import torch.distributed

from fsdp_conformance.adapters.impl import ImplAdapter


class Untraced(ImplAdapter):
    """Lacks the comm trace; notes in a file when a rank asks it what it declares."""

    name = "untraced"

    @property
    def declarations(self):
        if torch.distributed.is_initialized():  # a rank (never the collecting process)
            pathlib.Path(os.environ["UNTRACED_MARK"]).touch()
        declared = ImplAdapter.declarations
        unsupported = {**declared.unsupported, "comm_trace": "no trace here"}
        return dataclasses.replace(declared, unsupported=unsupported)
'''


def test_a_cell_lacking_a_feature_is_skipped_at_collection(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(untraced=textwrap.dedent(_UNTRACED))
    mark = pytester.path / "asked-in-a-rank"
    junit = pytester.path / "junit.xml"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UNTRACED_MARK", str(mark))
        result = pytester.runpytest_subprocess(
            "--pyargs", "fsdp_conformance.suite", "-p", "no:cacheprovider", "-n", "0",
            "--fsdp-impl=untraced:Untraced", "-k", "test_counts_per_phase and nested",
            f"--junitxml={junit}", "-rs",
        )  # fmt: skip
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*adapter 'untraced' does not support 'comm_trace': no trace*"])
    assert not mark.exists(), "a not-applicable cell was dispatched to the ranks"
    for case in ET.parse(junit).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        assert props == {
            "fsdp_check": "comm.counts",
            "fsdp_verdict": "not applicable",
            "fsdp_reason": "adapter 'untraced' does not support 'comm_trace': no trace here",
            "fsdp_feature": "comm_trace",
        }, props


def test_a_result_travels_as_report_properties() -> None:
    from fsdp_conformance import checks

    result = checks.Result("parity.ddp", checks.DEVIATION, "why\n  so", failure="E: x")
    assert result.properties() == [
        ("fsdp_check", "parity.ddp"),
        ("fsdp_verdict", "deviation"),
        ("fsdp_reason", "why so"),
        ("fsdp_failure", "E: x"),
    ]
    back = checks.Result.from_properties([("other", 1), *result.properties()])
    assert back == checks.Result("parity.ddp", checks.DEVIATION, "why so", failure="E: x")
    assert back.outcome == "xfail" and checks.Result.from_properties([("other", 1)]) is None


def test_a_cell_that_never_reached_its_check_gets_the_verdict_of_its_report() -> None:
    from types import SimpleNamespace

    from fsdp_conformance import checks

    crash = SimpleNamespace(message="rank 1 of 2 hung: no result after 300 s\n  stacks ...")
    hung = SimpleNamespace(outcome="failed", longrepr=SimpleNamespace(reprcrash=crash))
    recorded = checks.Result("parity.ddp", checks.PASS)
    assert checks.Result.of_report("parity.ddp", hung, recorded) == checks.Result(
        "parity.ddp", checks.FAIL, "rank 1 of 2 hung: no result after 300 s"
    )
    gpu = SimpleNamespace(outcome="skipped", longrepr=("f.py", 1, "Skipped: needs 2 GPUs"))
    assert checks.Result.of_report("overlap", gpu).reason == "needs 2 GPUs"
    deviation = checks.Result("parity.ddp", checks.DEVIATION, "declared", failure="E: x")
    xfailed = SimpleNamespace(outcome="skipped", wasxfail="reason: E: x -- known", longrepr=None)
    assert checks.Result.of_report("parity.ddp", xfailed, deviation) is deviation
    assert checks.Result.of_report("parity.ddp", xfailed).reason == "E: x -- known"
