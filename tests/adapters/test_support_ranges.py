"""Declared support ranges and the one place per adapter for torch internals."""

from __future__ import annotations

import pathlib
import re
import types

import pytest
import torch

import fsdp_conformance.suite  # noqa: F401  (registers the checks the deviations name)
from fsdp_conformance import _patching, constants
from fsdp_conformance.adapters import _fsdp1_internals, _fsdp2_internals, _support, get_adapter
from fsdp_conformance.adapters import deviations as adapter_deviations
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters._support import SupportRange
from fsdp_conformance.checks import CheckFailure

BUILTINS = ("impl", "torch-fsdp1", "torch-fsdp2", "fairscale", "deepspeed")
RANGE = SupportRange("torch", "2.8.0", "2.16", ("2.8.0", "2.15.0"))
# the torch CI installs (.ci/run): every built-in adapter must support it
CI_TORCH = re.search(
    r"torch==([\d.]+)", (pathlib.Path(__file__).parents[2] / ".ci" / "run").read_text()
).group(1)


@pytest.fixture(autouse=True)
def _no_untested(monkeypatch):
    monkeypatch.delenv(constants.ENV_UNTESTED_VERSIONS, raising=False)


def test_release_numbers():
    assert _support.release("2.15.0+cu132") == (2, 15, 0)
    assert _support.release("2.16") == (2, 16, 0)
    assert _support.release("2.8.0a0+git123") == (2, 8, 0)
    with pytest.raises(ValueError, match="cannot read a release number from version 'nightly'"):
        _support.release("nightly")


@pytest.mark.parametrize("version", ["2.8.0", "2.13.0+cpu", "2.15.3+cu132"])
def test_inside_the_range_no_problem(version):
    assert RANGE.problem(version) is None


def test_older_is_refused_naming_both_versions():
    problem = RANGE.problem("2.6.0+cu124")
    assert problem == (
        "torch 2.6.0+cu124 is older than this adapter supports (torch>=2.8.0,<2.16, tested on "
        "2.8.0, 2.15.0)"
    )


def test_newer_is_refused_unless_untested_versions_are_allowed(monkeypatch):
    problem = RANGE.problem("2.16.0")
    assert problem.startswith("torch 2.16.0 is newer than this adapter was tested with")
    assert f"set {constants.ENV_UNTESTED_VERSIONS}=1 to run it anyway" in problem
    assert RANGE.problem("2.16.0", allow_newer=True) is None
    monkeypatch.setenv(constants.ENV_UNTESTED_VERSIONS, "1")
    assert RANGE.problem("2.16.0") is None
    assert RANGE.problem("2.4.1") is not None  # never the lower end


def test_a_range_must_not_be_empty():
    with pytest.raises(ValueError, match="minimum 2.16 >= 2.16"):
        SupportRange("torch", "2.16", "2.16", ())


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_adapter_supports_this_ci_torch(name):
    if _support.release(torch.__version__) != _support.release(CI_TORCH):
        pytest.skip(
            f"torch {torch.__version__} is not the torch CI pins ({CI_TORCH}, .ci/run): outside "
            "an adapter's range its cells are not applicable, which is no defect of ours"
        )
    assert adapter_features.support_problem(get_adapter(name)) is None, torch.__version__


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_adapter_refuses_an_old_torch_in_one_line(monkeypatch, name):
    monkeypatch.setattr(torch, "__version__", "2.6.0+cpu")
    problem = adapter_features.support_problem(get_adapter(name))
    supported = "torch>=2.8.0,<2.16, tested on 2.8.0, 2.13.0, 2.14.1, 2.15.0"
    if name == "torch-fsdp2":
        supported = "torch>=2.13.0,<2.16, tested on 2.13.0, 2.14.1, 2.15.0"
    if name == "deepspeed":
        supported = "torch>=2.13.0,<2.15, tested on 2.13.0, 2.14.1"
    assert problem == (
        f"torch 2.6.0+cpu is older than this adapter supports ({supported}); docs/compatibility.md"
    )
    assert "\n" not in problem


def test_torch_fsdp2_starts_at_2_13(monkeypatch):
    # 2.8.0 was run: FSDP2 2.8 sums gradients on gloo (ReduceOp.AVG), so it is outside the range
    monkeypatch.setattr(torch, "__version__", "2.8.0+cu128")
    assert "torch 2.8.0+cu128 is older" in adapter_features.support_problem(
        get_adapter("torch-fsdp2")
    )
    assert adapter_features.support_problem(get_adapter("torch-fsdp1")) is None


@pytest.mark.parametrize(
    "library, installed, problem",
    [
        (
            "fairscale",
            "0.4.0",
            "fairscale 0.4.0 is older than this adapter supports (fairscale>=0.4.13,<0.4.14",
        ),
        (
            "deepspeed",
            "0.20.1",
            (
                "deepspeed 0.20.1 is newer than this adapter was tested with (deepspeed>=0.19.0,"
                "<0.20, tested on 0.19.8)"
            ),
        ),
    ],
)
def test_an_extra_declares_its_own_release(monkeypatch, library, installed, problem):
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")  # a torch every range takes
    real = _support.installed_version
    monkeypatch.setattr(
        _support,
        "installed_version",
        lambda name: installed if name == library else real(name),
    )
    said = adapter_features.support_problem(get_adapter(library))
    assert said.startswith(problem), said
    # the library not installed is not a range problem (every check skips with the install line)
    monkeypatch.setattr(_support, "installed_version", lambda name: None)
    assert adapter_features.support_problem(get_adapter(library)) is None


# ---------------------------------------------------------------- torch FSDP2 internals
def test_fsdp2_param_groups_of_each_known_shape():
    group = object()
    assert _fsdp2_internals.param_groups(types.SimpleNamespace(_fsdp_param_groups=[group])) == [
        group
    ]
    assert _fsdp2_internals.param_groups(types.SimpleNamespace(_fsdp_param_group=group)) == [
        group
    ]  # torch 2.8: one group per state
    assert _fsdp2_internals.param_groups(types.SimpleNamespace(_fsdp_param_group=None)) == []


def test_fsdp2_internals_raise_one_clear_error_when_none_matches():
    with pytest.raises(_fsdp2_internals.FSDP2InternalsError) as error:
        _fsdp2_internals.param_groups(types.SimpleNamespace())
    message = str(error.value)
    assert message.startswith(
        "torch FSDP2 internals moved: FSDPState has neither _fsdp_param_groups nor "
        f"_fsdp_param_group (torch {torch.__version__}; "
        "fsdp_conformance/adapters/_fsdp2_internals.py knows torch 2.8.0, 2.13.0, 2.14.1, 2.15.0)"
    )
    assert "\n" not in message
    with pytest.raises(_fsdp2_internals.FSDP2InternalsError, match=r"SimpleNamespace\._comm_ctx"):
        _fsdp2_internals.comm_context(types.SimpleNamespace(_device_handle=1, _is_root=None))


def test_fsdp2_patches_are_recorded_once_with_the_versions():
    from fsdp_conformance.adapters import torch_fsdp2

    torch_fsdp2._patch_torch_fsdp2()
    group_class = _fsdp2_internals.param_group_class()
    unshard = group_class.unshard
    torch_fsdp2._patch_torch_fsdp2()  # idempotent: not wrapped twice
    assert group_class.unshard is unshard
    records = [
        r for r in _patching.active_patches() if r.key == "fsdp-conformance torch-fsdp2 comm trace"
    ]
    assert {r.attribute for r in records} == {"unshard", "reshard", "post_backward"}
    assert all(r.written_for == "torch 2.8.0/2.13.0/2.14.1/2.15.0" for r in records)
    assert all(r.running == f"torch {torch.__version__}" for r in records)


# ---------------------------------------------------------------- torch FSDP1 internals
def test_fsdp1_internals_raise_one_clear_error():
    with pytest.raises(_fsdp1_internals.FSDP1InternalsError) as error:
        _fsdp1_internals.handle_of(types.SimpleNamespace())
    assert str(error.value).startswith(
        f"torch FSDP1 internals moved: SimpleNamespace._handle is missing (torch "
        f"{torch.__version__}; fsdp_conformance/adapters/_fsdp1_internals.py knows torch 2.8.0"
    )
    handle_class = _fsdp1_internals.flat_param_handle_class()
    assert hasattr(handle_class, "_all_gather_flat_param")


# ---------------------------------------------------------------- built-in deviations
def _builtin_deviations():
    return [
        (name, deviation)
        for name in ("torch-fsdp1", "torch-fsdp2", "fairscale")
        for deviation in get_adapter(name).declarations.known_deviations
    ]


@pytest.mark.parametrize(
    ("name", "deviation"),
    _builtin_deviations(),
    ids=[f"{name}-{deviation.check}" for name, deviation in _builtin_deviations()],
)
def test_every_builtin_deviation_states_its_failure_and_where_it_was_measured(name, deviation):
    # an envelope of what the check measured, or the implementation's own exact error
    assert deviation.envelope is not None or deviation.match, f"{name} {deviation.check}"
    assert deviation.measured_on.startswith(("torch ", "fairscale ")), deviation.measured_on
    assert "(torch 2.13.0)" not in deviation.reason  # the version is measured_on's job


def test_the_fsdp2_mixed_devices_deviation_does_not_hide_a_moved_internal():
    # torch 2.8 with the old adapter: an AttributeError inside this cell was reported as the
    # declared deviation; only the "accepts the misuse" failure is covered
    deviation = adapter_deviations.find_deviation(
        get_adapter("torch-fsdp2"), "misuse.mixed_devices"
    )
    crash = AttributeError("'FSDPState' object has no attribute '_fsdp_param_groups'")
    assert not deviation.covers(crash)
    report = AssertionError(
        "adapter 'torch-fsdp2', parameters on cpu and meta: the error does not name the problem "
        "(expected a message matching 'device|meta'), got AttributeError: 'FSDPState' ..."
    )
    report.__cause__ = crash
    assert not deviation.covers(report)
    accepted = CheckFailure(
        "adapter 'torch-fsdp2', parameters on cpu and meta: no exception was raised (expected "
        "one matching 'device|meta')",
        "no error raised",
    )
    assert deviation.covers(accepted)
