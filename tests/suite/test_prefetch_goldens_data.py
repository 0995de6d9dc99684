"""The prefetch-order goldens are package data: reading, diffing, accepting, refusing."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

from fsdp_conformance import vocab
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
    env[vocab.ENV_ACCEPT_GOLDENS] = "1"
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
    monkeypatch.delenv(vocab.ENV_ACCEPT_GOLDENS, raising=False)
    pytester.makepyfile(
        f"""
        import os

        def test_accepting():
            assert os.environ.get({vocab.ENV_ACCEPT_GOLDENS!r}) == "1"
        """
    )
    assert pytester.runpytest("-p", "no:xdist", "--fsdp-accept-goldens").ret == 0
    assert vocab.ENV_ACCEPT_GOLDENS not in os.environ
    assert pytester.runpytest("-p", "no:xdist").ret == 1


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({vocab.ENV_ACCEPT_GOLDENS: "0"}, False),
        ({vocab.ENV_ACCEPT_GOLDENS: "1"}, True),
        ({"EXPECTTEST_ACCEPT": "1"}, True),
        ({"EXPECTTEST_ACCEPT": "0"}, False),
    ],
)
def test_accepting_reads_the_variables(not_accepting, monkeypatch, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert prefetch_goldens.accepting() is expected


def test_a_bad_accept_value_names_the_variable(not_accepting, monkeypatch):
    monkeypatch.setenv(vocab.ENV_ACCEPT_GOLDENS, "yes")
    with pytest.raises(ValueError, match=r"FSDP_CONFORMANCE_ACCEPT_GOLDENS='yes': set it to 1"):
        prefetch_goldens.accepting()


def test_pyproject_ships_the_goldens_and_the_cli_package():
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["fsdp_conformance.suite"]
    suite = PACKAGE / "suite"
    files = [path.relative_to(suite) for path in (suite / "goldens").rglob("*") if path.is_file()]
    assert len(files) == 36  # 12 cases each for impl, torch-fsdp1, torch-fsdp2
    assert all(any(path.match(pattern) for pattern in patterns) for path in files), patterns
    assert "fsdp_conformance.cli" in setuptools["packages"]
