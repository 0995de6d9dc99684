"""A written repro.py exits 1 while the failure reproduces, 0 once it is gone and 2 when it
cannot run here (fsdp-conformance not importable, adapter missing, its extra missing), each
with one last line saying which -- a reproduction that did not run is never "still fails"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_conformance.suite.fuzz.repro import write_repro
from fsdp_conformance.suite.fuzz.spec import Block, FuzzCase, ModelSpec, Seq

HERE = os.path.dirname(os.path.abspath(__file__))
# a bias of one element: fewer elements than ranks, which fuzz_mutants.DROP_SMALL_GRADS drops
CASE = FuzzCase(ModelSpec(4, Seq((Block("linear", 4, 1),))))


def _repro(tmp_path: Path, impl: str) -> Path:
    path = tmp_path / "repro.py"
    write_repro(str(path), CASE, impl, 2, 0, "boom")
    return path


def _run(*args: str, cwd: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_still_fails_1_passes_now_0(tmp_path: Path) -> None:
    repro = str(_repro(tmp_path, "fuzz_mutants:DROP_SMALL_GRADS"))
    fails = _run(repro, cwd=HERE)  # the mutant's module is found next to where it runs
    assert fails.returncode == 1, fails.stdout + fails.stderr
    assert fails.stdout.strip().splitlines()[-1] == "still fails (exit 1)"
    fixed = _run(repro, "--impl", "impl", cwd=HERE)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert fixed.stdout.strip().splitlines()[-1] == "passes now (exit 0)"


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("adapter-not-importable", "cannot import module 'fuzz_mutants'"),
        ("extra-missing", "pip install 'fsdp-conformance[fairscale]'"),
        ("package-not-importable", "fsdp-conformance does not import here"),
    ],
)
def test_cannot_run_is_2_with_one_line(tmp_path: Path, how: str, message: str) -> None:
    repro = str(_repro(tmp_path, "fuzz_mutants:DROP_SMALL_GRADS"))
    if how == "adapter-not-importable":  # run from another folder than the adapter's
        done = _run(repro, cwd=str(tmp_path))
    elif how == "extra-missing":
        hidden = tmp_path / "hidden" / "fairscale"
        hidden.mkdir(parents=True)
        (hidden / "__init__.py").write_text(
            "raise ModuleNotFoundError(\"No module named 'fairscale'\", name='fairscale')\n"
        )
        done = _run(
            repro, "--impl", "fairscale", cwd=str(tmp_path), env={"PYTHONPATH": str(hidden.parent)}
        )
    else:
        blocker = "import sys, runpy; sys.modules['fsdp_conformance'] = None; "
        done = _run("-c", blocker + f"runpy.run_path({repro!r}, run_name='__main__')", cwd=HERE)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cannot run (exit 2): "), done.stderr
    assert message in lines[0], lines[0]
