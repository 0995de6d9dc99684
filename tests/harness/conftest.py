"""Fixtures for the harness's own tests: a private TMPDIR and a directory where rank
processes of inner pytest runs record their pids, so that leftovers can be checked."""

from __future__ import annotations

import pathlib
import tempfile

import psutil
import pytest

# torch is imported here, before any pytester run: an in-process run drops the modules first
# imported inside it, and torch imported a second time in one process crashes it
import torch  # noqa: F401

# Inner test files call record_pid() (from this snippet) in their ranks.
RECORD_PID = """
import os


def record_pid():
    directory = os.environ.get("HARNESS_PID_DIR")
    if directory:
        open(os.path.join(directory, str(os.getpid())), "w").close()
"""


@pytest.fixture
def private_tmpdir(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """TMPDIR for the inner pytest run (in-process and subprocess)."""
    directory = tmp_path / "tmpdir"
    directory.mkdir()
    monkeypatch.setenv("TMPDIR", str(directory))
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    return directory


@pytest.fixture
def pid_dir(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    directory = tmp_path / "pids"
    directory.mkdir()
    monkeypatch.setenv("HARNESS_PID_DIR", str(directory))
    return directory


def write_test(pytester: pytest.Pytester, name: str, source: str) -> pathlib.Path:
    """Write an inner test file verbatim (``makepyfile`` re-indents and drops lines)."""
    path = pytester.path / f"{name}.py"
    path.write_text(source)
    return path


def runtime_files(tmpdir: pathlib.Path) -> list[str]:
    """Files and directories the runtime left in ``tmpdir``."""
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith("fsdp-conformance-"))


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_no_leftovers(pid_dir: pathlib.Path, tmpdir: pathlib.Path, min_pids: int = 2) -> None:
    """Every recorded rank process is gone, none is our child, and no temp file remains."""
    pids = [int(p.name) for p in pid_dir.iterdir()]
    assert len(pids) >= min_pids, f"inner ranks recorded only {pids}"
    assert [pid for pid in pids if alive(pid)] == []
    assert rank_children(tmpdir) == []
    assert runtime_files(tmpdir) == []


def rank_children(under: pathlib.Path) -> list[int]:
    """Rank processes still alive below this process whose rendezvous lies under ``under``
    (ranks of inner runs; the outer session's own pooled ranks live elsewhere)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            # a rank forked by the zygote shows the zygote's initial environment; its log
            # (standard output) lies in its rank set's folder
            store = child.environ().get("FSDP_CONFORMANCE_STORE", "")
            paths = [store] + [f.path for f in child.open_files()]
            mine = any(path.startswith(str(under)) for path in paths)
            if mine and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


# A function that reports, from inside a 1-rank test, how its rank process was started.
PROBE = """
import json, os, sys

def probe(dist, out):
    with open(out, "w") as stream:
        json.dump({
            "session_leader": os.getsid(0) == os.getpid(),
            "stdin": os.path.realpath("/proc/self/fd/0"),
            "cwd": os.getcwd(),
            "env": dict(os.environ),
            "parent": os.getppid(),
            "device": dist.device.type,
            "backend": dist.backend,
            "suite_modules": sorted(m for m in sys.modules if m.startswith("fsdp_conformance.s")),
        }, stream)
"""


@pytest.fixture
def rank_probe(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    """``probe(name, backend="gloo")``: run :data:`PROBE` in one rank (cwd ``tmp_path``) and
    return what it saw."""
    import json

    from fsdp_conformance.harness.controller import run_function

    (tmp_path / "rank_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)

    def probe(name: str, backend: str | None = "gloo") -> dict:
        out = tmp_path / f"{name}.json"
        result = run_function(
            "rank_probe",
            "probe",
            {"out": str(out)},
            world_size=1,
            timeout=120,
            impl="impl",
            test_id=name,
            backend=backend,
        )
        assert result.verdict.status == "passed", result.verdict.message
        return json.loads(out.read_text())

    return probe
