"""The prefetch-order goldens are package data: reading, diffing, accepting, refusing."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

from fsdp_conformance import constants
from fsdp_conformance.suite import prefetch_goldens

pytest_plugins = ["pytester"]

PACKAGE = pathlib.Path(prefetch_goldens.__file__).resolve().parents[1]
ROOT = PACKAGE.parent
CASE = "nested-bwd=None-fwd=0"
CASES = [
    f"{model}-bwd={bwd}-fwd={fwd}"
    for model in ("nested", "transformer")
    for bwd in ("None", "BACKWARD_PRE", "BACKWARD_POST")
    for fwd in (0, 1)
]


@pytest.fixture
def not_accepting(monkeypatch):
    for name in prefetch_goldens.ACCEPT_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("adapter", ["impl", "torch-fsdp1"])
def test_every_case_has_a_golden(adapter):
    assert prefetch_goldens.has_goldens(adapter)
    for case in CASES:
        golden = prefetch_goldens.read_golden(adapter, case)
        assert golden is not None, f"{adapter}/{case}"
        assert golden.startswith("iteration 1 forward:\n") and golden.endswith("\n")


def test_an_adapter_without_goldens_skips(not_accepting):
    assert not prefetch_goldens.has_goldens("fairscale")
    with pytest.raises(pytest.skip.Exception, match="has no prefetch-order goldens"):
        prefetch_goldens.check_golden("fairscale", CASE, "anything\n")


def test_the_golden_passes_and_a_change_fails_with_a_diff(not_accepting):
    golden = prefetch_goldens.read_golden("impl", CASE)
    prefetch_goldens.check_golden("impl", CASE, golden)
    changed = golden.replace("all_gather module.1 FORWARD", "all_gather module.1 IDLE", 1)
    assert changed != golden
    with pytest.raises(AssertionError) as failure:
        prefetch_goldens.check_golden("impl", CASE, changed)
    message = str(failure.value)
    assert f"adapter 'impl', case {CASE!r}: the prefetch order differs" in message
    assert "-  all_gather module.1 FORWARD" in message
    assert "+  all_gather module.1 IDLE" in message
    assert "--fsdp-accept-goldens" in message


def test_a_missing_case_names_the_file(not_accepting):
    with pytest.raises(AssertionError, match=r"goldens/impl/no-such-case\.txt"):
        prefetch_goldens.check_golden("impl", "no-such-case", "x\n")


def test_accept_writes_into_a_source_tree(tmp_path):
    suite = tmp_path / "checkout" / "fsdp_conformance" / "suite"
    written = prefetch_goldens.accept_golden("impl", CASE, "new order\n", package_dir=suite)
    assert written == suite.resolve() / "goldens" / "impl" / f"{CASE}.txt"
    assert written.read_text() == "new order\n"


def test_accept_refuses_an_installed_package(tmp_path):
    suite = tmp_path / "lib" / "python3.11" / "site-packages" / "fsdp_conformance" / "suite"
    with pytest.raises(prefetch_goldens.GoldenAcceptError, match=r"pip install -e \."):
        prefetch_goldens.accept_golden("impl", CASE, "new order\n", package_dir=suite)
    assert not suite.exists()


def _copy_package(destination: pathlib.Path) -> pathlib.Path:
    """A copy of the package (and its model zoo) at ``destination``/fsdp_conformance."""
    ignore = shutil.ignore_patterns("__pycache__")
    copy = destination / "fsdp_conformance"
    shutil.copytree(PACKAGE, copy, ignore=ignore)
    shutil.copytree(ROOT / "models", copy / "models", ignore=ignore)
    return copy


ACCEPT_IN_COPY = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    from fsdp_conformance.suite import prefetch_goldens
    assert prefetch_goldens.__file__.startswith(sys.argv[1]), prefetch_goldens.__file__
    try:
        prefetch_goldens.check_golden("impl", sys.argv[2], "accepted order\\n")
    except prefetch_goldens.GoldenAcceptError as error:
        print("refused:", error)
    """
)


def _accept_in_copy(location: pathlib.Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in prefetch_goldens.ACCEPT_ENV_VARS}
    env[constants.ENV_ACCEPT_GOLDENS] = "1"
    return subprocess.run(
        [sys.executable, "-c", ACCEPT_IN_COPY, str(location), CASE],
        capture_output=True,
        text=True,
        env=env,
        cwd=location,
        timeout=300,
        check=True,
    )


def test_accepting_rewrites_the_checkout_it_was_imported_from(tmp_path):
    original = (PACKAGE / "suite" / "goldens" / "impl" / f"{CASE}.txt").read_text()
    copy = _copy_package(tmp_path / "checkout")
    _accept_in_copy(tmp_path / "checkout")
    assert (copy / "suite" / "goldens" / "impl" / f"{CASE}.txt").read_text() == "accepted order\n"
    assert (PACKAGE / "suite" / "goldens" / "impl" / f"{CASE}.txt").read_text() == original


def test_accepting_in_site_packages_is_refused_in_one_line(tmp_path):
    site = tmp_path / "lib" / "site-packages"
    copy = _copy_package(site)
    result = _accept_in_copy(site)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refused: cannot accept"), result.stdout
    assert "pip install -e ." in lines[0]
    golden = (copy / "suite" / "goldens" / "impl" / f"{CASE}.txt").read_text()
    assert golden == (PACKAGE / "suite" / "goldens" / "impl" / f"{CASE}.txt").read_text()


def test_the_option_sets_the_accept_variable_for_the_session_only(pytester, monkeypatch):
    monkeypatch.delenv(constants.ENV_ACCEPT_GOLDENS, raising=False)
    pytester.makepyfile(
        f"""
        import os

        def test_accepting():
            assert os.environ.get({constants.ENV_ACCEPT_GOLDENS!r}) == "1"
        """
    )
    assert pytester.runpytest("-p", "no:xdist", "--fsdp-accept-goldens").ret == 0
    assert constants.ENV_ACCEPT_GOLDENS not in os.environ
    assert pytester.runpytest("-p", "no:xdist").ret == 1


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({constants.ENV_ACCEPT_GOLDENS: "0"}, False),
        ({constants.ENV_ACCEPT_GOLDENS: "1"}, True),
        ({"EXPECTTEST_ACCEPT": "1"}, True),
        ({"EXPECTTEST_ACCEPT": "0"}, False),
    ],
)
def test_accepting_reads_the_variables(not_accepting, monkeypatch, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert prefetch_goldens.accepting() is expected


def test_a_bad_accept_value_names_the_variable(not_accepting, monkeypatch):
    monkeypatch.setenv(constants.ENV_ACCEPT_GOLDENS, "yes")
    with pytest.raises(ValueError, match=r"FSDP_CONFORMANCE_ACCEPT_GOLDENS='yes': set it to 1"):
        prefetch_goldens.accepting()


def test_pyproject_ships_the_goldens_and_the_cli_package():
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["fsdp_conformance.suite"]
    suite = PACKAGE / "suite"
    files = [path.relative_to(suite) for path in (suite / "goldens").rglob("*") if path.is_file()]
    # 12 cases each for impl, torch-fsdp1, torch-fsdp2 (+ goldens recorded on other torches)
    assert len([path for path in files if len(path.parts) == 3]) == 36, files
    assert all(any(path.match(pattern) for pattern in patterns) for path in files), patterns
    assert "fsdp_conformance.cli" in setuptools["packages"]


# ---------------------------------------------------------------- goldens that travel
def _as_torch(monkeypatch, version):
    monkeypatch.setattr(prefetch_goldens.torch, "__version__", version)


def test_nearest_version_prefers_the_closest_then_the_older():
    nearest = prefetch_goldens.nearest_version
    assert nearest(["2.13"], "2.15") == "2.13"
    assert nearest(["2.8", "2.13", "2.15"], "2.14") == "2.13"
    assert nearest(["2.8", "2.13"], "2.9") == "2.8"
    assert nearest(["2.13", "2.15"], "2.15") == "2.15"
    assert nearest([], "2.15") is None


@pytest.mark.parametrize("adapter", ["torch-fsdp1", "torch-fsdp2"])
def test_on_another_torch_a_matching_trace_passes_and_says_where_it_was_recorded(
    not_accepting, monkeypatch, adapter
):
    golden = prefetch_goldens.read_golden(adapter, CASE, "2.13")
    _as_torch(monkeypatch, "2.99.1+cu999")
    assert prefetch_goldens.read_golden(adapter, CASE) == golden  # the nearest: 2.13
    note = prefetch_goldens.check_golden(adapter, CASE, golden)
    assert note == "recorded on torch 2.13, matches on torch 2.99.1+cu999"


def test_on_another_torch_a_difference_fails_with_the_diff_never_skips(not_accepting, monkeypatch):
    golden = prefetch_goldens.read_golden("torch-fsdp2", CASE, "2.13")
    changed = golden.replace("FORWARD", "IDLE", 1)
    _as_torch(monkeypatch, "2.99.0")
    with pytest.raises(AssertionError) as failure:
        prefetch_goldens.check_golden("torch-fsdp2", CASE, changed)
    message = str(failure.value)
    assert "recorded on torch 2.13 (no golden for torch 2.99 yet): a difference to review" in (
        message
    )
    assert "accepting records a golden for torch 2.99" in message
    assert "--- golden torch-fsdp2/" in message and "(torch 2.13)" in message
    assert "+" in message and "IDLE" in message


def test_on_the_recorded_torch_there_is_no_travel_note(not_accepting, monkeypatch):
    golden = prefetch_goldens.read_golden("torch-fsdp1", CASE, "2.13")
    _as_torch(monkeypatch, "2.13.0+cpu")
    assert prefetch_goldens.check_golden("torch-fsdp1", CASE, golden) is None


def test_accepting_on_another_torch_records_a_golden_for_it(tmp_path, monkeypatch):
    suite = tmp_path / "checkout" / "fsdp_conformance" / "suite"
    _as_torch(monkeypatch, "2.15.0+cu132")
    written = prefetch_goldens.accept_golden("torch-fsdp2", CASE, "new\n", package_dir=suite)
    assert written == suite.resolve() / "goldens" / "torch-fsdp2" / "torch-2.15" / f"{CASE}.txt"
    _as_torch(monkeypatch, "2.13.0")
    base = prefetch_goldens.accept_golden("torch-fsdp2", CASE, "base\n", package_dir=suite)
    assert base == suite.resolve() / "goldens" / "torch-fsdp2" / f"{CASE}.txt"
    # impl's goldens do not depend on torch: one golden whatever runs
    _as_torch(monkeypatch, "2.15.0")
    impl = prefetch_goldens.accept_golden("impl", CASE, "x\n", package_dir=suite)
    assert impl == suite.resolve() / "goldens" / "impl" / f"{CASE}.txt"


def test_a_golden_recorded_on_the_running_torch_wins_over_the_base(tmp_path, monkeypatch):
    copy = _copy_package(tmp_path / "checkout")
    folder = copy / "suite" / "goldens" / "torch-fsdp1" / "torch-2.15"
    folder.mkdir()
    (folder / f"{CASE}.txt").write_text("recorded on 2.15\n")
    script = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        from fsdp_conformance.suite import prefetch_goldens
        prefetch_goldens.torch.__version__ = "2.15.0"
        print(prefetch_goldens.recorded_versions("torch-fsdp1", sys.argv[2]))
        print(prefetch_goldens.check_golden("torch-fsdp1", sys.argv[2], "recorded on 2.15\\n"))
        prefetch_goldens.torch.__version__ = "2.16.0"
        print(prefetch_goldens.check_golden("torch-fsdp1", sys.argv[2], "recorded on 2.15\\n"))
        prefetch_goldens.torch.__version__ = "2.14.1"  # 2.13 and 2.15 as near: the older
        try:
            prefetch_goldens.check_golden("torch-fsdp1", sys.argv[2], "recorded on 2.15\\n")
        except AssertionError as error:
            print(str(error).splitlines()[0].split("golden ", 1)[1])
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in prefetch_goldens.ACCEPT_ENV_VARS}
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "checkout"), CASE],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    assert result.stdout.splitlines() == [
        "['2.13', '2.15']",
        "None",
        "recorded on torch 2.15, matches on torch 2.16.0",
        "recorded on torch 2.13 (no golden for torch 2.14 yet): a difference to review on torch "
        "2.14.1; if torch 2.14's order is right, accepting records a golden for torch 2.14 (if "
        "the change is intended, rerun with --fsdp-accept-goldens (or EXPECTTEST_ACCEPT=1) in one "
        "process (-p no:xdist)):",
    ], result.stdout
