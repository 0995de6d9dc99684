"""What cannot work is refused before anything starts, in one line.

A built-in adapter whose optional package is missing is simulated by a package of the same name,
first on PYTHONPATH, that raises ModuleNotFoundError as a missing package does (the CLI, pytest
and their rank processes all see it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

EXTRAS = ("fairscale", "deepspeed")
# seconds a CLI subprocess may take to refuse (the refusal comes before torch is imported)
TIMEOUT = 120


def hide_packages(root: Path) -> str:
    """A folder whose fairscale and deepspeed packages fail to import as missing ones do."""
    for package in EXTRAS:
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{package}'\", name='{package}')\n"
        )
    return str(root)


@pytest.fixture
def hidden_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": hide_packages(tmp_path / "hidden"), "TMPDIR": str(tmp_path)}


@pytest.mark.parametrize("extra", EXTRAS)
@pytest.mark.parametrize(
    "command",
    [["run", "-n", "0"], ["fuzz", "--examples", "1"], ["overlap"], ["timeline"], ["coverage"]],
    ids=lambda command: command[0],
)
def test_cli_refuses_a_builtin_adapter_without_its_extra(
    command: list[str], extra: str, hidden_env: dict[str, str], tmp_path: Path
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fsdp_conformance.cli", *command, "--impl", extra],
        cwd=tmp_path,
        env=hidden_env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"pip install 'fsdp-conformance[{extra}]'" in lines[0], lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize("extra", EXTRAS)
def test_plugin_refuses_a_builtin_adapter_without_its_extra(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, extra: str
) -> None:
    monkeypatch.setenv("PYTHONPATH", hide_packages(pytester.path / "hidden"))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pyargs", "fsdp_conformance.suite", "--fsdp-impl", extra
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stderr.fnmatch_lines([f"ERROR: *pip install 'fsdp-conformance[[]{extra}[]]'*"])
    assert "collected" not in result.stdout.str()


def test_plugin_refuses_an_unknown_adapter_listing_the_known_ones(
    pytester: pytest.Pytester,
) -> None:
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pyargs", "fsdp_conformance.suite", "--fsdp-impl",
        "torch-fsdp3",
    )  # fmt: skip
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stderr.fnmatch_lines(
        ["ERROR: --fsdp-impl 'torch-fsdp3'*impl, torch-fsdp1, torch-fsdp2, fairscale, deepspeed*"]
    )
    assert "collected" not in result.stdout.str()
