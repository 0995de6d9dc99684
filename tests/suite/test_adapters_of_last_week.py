"""Adapters written from the docs of an older protocol: one that overrides a hook and calls
``super()`` runs (the hooks are `Adapter` methods); one that defines a removed member ends
``fsdp-conformance run`` and ``pytest --fsdp-impl`` with one line naming the replacement and a
clean non-zero exit, before any worker or rank starts (docs/adapters.md, "Removed names")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# overrides the optimizer and reaches the plain one through super(), noting each call
_OVERRIDES_A_HOOK = """
import os

from my_fsdp_adapter import MyFSDPAdapter


class LastWeek(MyFSDPAdapter):
    name = "last-week"

    def optimizer(self, model, name="sgd", **hyperparameters):
        with open(os.environ["LAST_WEEK_LOG"], "a") as log:
            log.write(name + "\\n")
        return super().optimizer(model, name, **hyperparameters)


ADAPTER = LastWeek()
"""

_PARITY = """
from fsdp_conformance.suite import BaseDDPParityTests


class TestParity(BaseDDPParityTests):
    models = ("nested",)
    world_sizes = (2,)
    coverage = "pairwise"
    mixed_precision_models = ()
"""


def test_a_hook_override_reaches_the_plain_hook_through_super(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = pytester.path / "optimizers.log"
    monkeypatch.setenv("LAST_WEEK_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLES), str(pytester.path)]))
    pytester.makepyfile(last_week=textwrap.dedent(_OVERRIDES_A_HOOK), test_parity_cells=_PARITY)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:xdist", "--fsdp-impl", "last_week:ADAPTER",
        "-k", "test_matches_ddp and FULL_SHARD", timeout=600,
    )  # fmt: skip
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 2, result.stdout.str()
    assert "failed" not in outcomes and "errors" not in outcomes, result.stdout.str()
    # each rank of each cell built its optimizer through the override
    assert log.read_text().split() == ["sgd"] * 2 * outcomes["passed"], log.read_text()


# a subclass of a built-in adapter still declaring through the removed unsupported()
_REMOVED_MEMBER = """
from fsdp_conformance.adapters.impl import ImplAdapter


class Sub(ImplAdapter):
    name = "sub"

    def unsupported(self):
        return {**super().unsupported(), "no_shard": "not here"}


ADAPTER = Sub()
"""
_LINE = (
    "adapter old_style_adapter.Sub uses a member removed from the Adapter protocol: "
    "'unsupported' (defined by Sub, used in Sub.unsupported): use declarations = "
    'Declarations(unsupported={feature: reason}) (docs/adapters.md, "Removed names")'
)


def test_a_removed_member_ends_run_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "old_style_adapter.py").write_text(textwrap.dedent(_REMOVED_MEMBER))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsdp_conformance.cli",
            "run",
            "--impl",
            "old_style_adapter:ADAPTER",
        ],
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [f"fsdp-conformance run: error: --impl {_LINE}"]
    assert "no tests ran" not in result.stdout + result.stderr


def test_a_removed_member_ends_pytest_with_one_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(old_style_adapter=textwrap.dedent(_REMOVED_MEMBER))
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-n", "2", "--pyargs", "fsdp_conformance.suite",
        "--fsdp-impl", "old_style_adapter:ADAPTER", timeout=300,
    )  # fmt: skip
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    assert result.stderr.lines[0] == f"ERROR: --fsdp-impl old_style_adapter:ADAPTER: {_LINE}"
    output = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in output and "no tests ran" not in output, output
