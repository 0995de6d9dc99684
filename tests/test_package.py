"""The package surface: lazy public names, the zoo mapping, and README/CI agreement."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import fsdp_conformance

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_public_names_resolve_without_importing_torch_first():
    code = (
        "import sys, fsdp_conformance as f\n"
        "assert 'torch' not in sys.modules, 'importing the package imported torch'\n"
        "for name in f.__all__:\n"
        "    getattr(f, name)\n"
        "print(sorted(f.__all__))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    ).stdout
    assert "FSDPTest" in out and "get_adapter" in out


def test_all_lists_exactly_the_lazy_exports():
    assert sorted(fsdp_conformance.__all__) == sorted(fsdp_conformance._EXPORTS)


def test_unknown_public_name_says_so():
    try:
        fsdp_conformance.no_such_name  # noqa: B018
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("expected AttributeError")


def test_model_zoo_is_installed_under_the_package_only():
    code = (
        "import importlib.util, fsdp_conformance.models as m\n"
        "print(m.__name__)\n"
        "print(importlib.util.find_spec('models') is None)\n"
    )
    # run from / so the repository folder is not on sys.path
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    ).stdout.split()
    assert out == ["fsdp_conformance.models", "True"]


def _readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("Run the tests", 1)[1]
    return re.search(r"```bash\n(.+?)\n```", section, re.S).group(1).strip()


def test_ci_runs_exactly_the_readme_test_command():
    command = _readme_test_command()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines, f"{command!r} not a line of .ci/run"
