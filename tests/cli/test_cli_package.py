"""The CLI package's shape: entry points, one module per command, no self-patching."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import fsdp_conformance
from fsdp_conformance import cli

PACKAGE = pathlib.Path(fsdp_conformance.__file__).resolve().parent


def test_python_dash_m_runs_main():
    result = subprocess.run(
        [sys.executable, "-m", "fsdp_conformance.cli", "--help"],
        capture_output=True,
        text=True,
        check=False,
        cwd="/",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for command in ("run", "overlap", "timeline"):
        assert command in result.stdout


def test_each_command_is_its_own_module():
    from fsdp_conformance.cli import overlap_table, run, timeline

    parser = cli.build_parser()
    handlers = {}
    for command in ("run", "overlap", "timeline"):
        args = parser.parse_args([command])
        handlers[command] = args.handler.__module__
    assert handlers == {
        "run": run.__name__,
        "overlap": overlap_table.__name__,
        "timeline": timeline.__name__,
    }


def imports_mock(path: pathlib.Path) -> bool:
    """Whether the module at ``path`` imports ``unittest.mock`` (or ``mock`` from unittest)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return any(name.startswith("unittest.mock") for name in names)


def test_shipped_code_does_not_patch_itself():
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if imports_mock(path)
    ]
    assert not offenders, f"shipped modules importing unittest.mock: {offenders}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from unittest import mock\n", True),
        ("import unittest.mock\n", True),
        ("from unittest.mock import patch\n", True),
        ("import unittest\n", False),
    ],
)
def test_the_mock_scan_sees_an_import(tmp_path, source, expected):
    module = tmp_path / "module.py"
    module.write_text(source)
    assert imports_mock(module) is expected


def test_overlap_config_takes_the_limiter_setting():
    torch = pytest.importorskip("torch")
    from fsdp_conformance.suite import overlap

    cpu = torch.device("cpu")
    assert overlap.overlap_config(cpu)["limit_all_gathers"] is False
    limited = overlap.overlap_config(cpu, limit_all_gathers=True)
    assert limited["limit_all_gathers"] is True
    assert {k: v for k, v in limited.items() if k != "limit_all_gathers"} == {
        k: v for k, v in overlap.overlap_config(cpu).items() if k != "limit_all_gathers"
    }


# What answers without running a cell; each must answer before torch (seconds) is imported
_ANSWERED_WITHOUT_TORCH = [
    ["--help"], ["run", "--help"], ["coverage", "--help"], ["frobnicate"], [],
    ["run", "--world-size", "0"], ["run", "--impl", "nope"], ["run", "--impl", "no_such_mod:X"],
    ["run", "-k", "a and"], ["run", "--cell", "TestNoSuch::test_x"], ["run", "--failed"],
    ["run", "-n", "100000"], ["conformance", "-k", "a and"], ["coverage", "--impl", "nope"],
    ["fuzz", "--examples", "0"], ["overlap", "--limit-all-gathers", "maybe"],
    ["timeline", "--layers", "2"],
]  # fmt: skip


def test_parsing_help_usage_errors_and_refusals_import_no_torch(tmp_path: pathlib.Path) -> None:
    """Every command pays for torch only when it runs cells: `--help` and a bad argument answer
    in well under a second (before, importing the CLI imported torch: 8-10 s on a busy host)."""
    script = (
        "import contextlib, io, sys\n"
        "from fsdp_conformance.cli import main\n"
        f"for argv in {_ANSWERED_WITHOUT_TORCH!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n"
        "            code = main(argv)\n"
        "        except SystemExit as exit:\n"
        "            code = exit.code\n"
        "    print(argv, code, 'torch' in sys.modules)\n"
    )
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False,
        cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == len(_ANSWERED_WITHOUT_TORCH), done.stdout
    for argv, line in zip(_ANSWERED_WITHOUT_TORCH, lines):
        assert line == f"{argv} {0 if '--help' in argv else 2} False", line
