"""Signal-safe cleanup: SIGTERM to pytest (a CI cancel, ``timeout``) ends the session like
Ctrl-C, so that no rank process and no temp directory is left; SIGINT or SIGTERM to the pid of
``fsdp-conformance`` alone ends it within 10 s, leaving no process and no temp file (a few
trials of benchmarks/bench_signals.py)."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import RECORD_PID, alive, runtime_files, write_test

pytest_plugins = ["pytester"]

# Seconds a started process may take to reach the point a test waits for (loaded 2-core host)
START_WAIT_S = 120


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def test_sigterm_to_pytest_ends_ranks_and_removes_temp_dirs(
    pytester: pytest.Pytester, private_tmpdir, pid_dir
) -> None:
    write_test(
        pytester,
        "test_inner",
        RECORD_PID
        + """
import time


def test_waits(dist):
    record_pid()
    time.sleep(300)
""",
    )
    pytest_process = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_inner.py"],
        cwd=pytester.path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert _wait_for(lambda: len(list(pid_dir.iterdir())) == 2, START_WAIT_S)
        assert runtime_files(private_tmpdir) != []  # the rank set's FileStore and logs
        pytest_process.send_signal(signal.SIGTERM)
        pytest_process.wait(timeout=60)
    finally:
        if pytest_process.poll() is None:
            pytest_process.kill()
            pytest_process.wait()
    pids = [int(p.name) for p in pid_dir.iterdir()]
    # ranks are reaped by pytest's teardown (a rank of a vanished parent exits within 0.5 s)
    assert _wait_for(lambda: not any(alive(pid) for pid in pids), 5)
    assert runtime_files(private_tmpdir) == []


def test_sigterm_handler_is_restored_after_the_session(pytester: pytest.Pytester) -> None:
    before = signal.getsignal(signal.SIGTERM)
    pytester.makepyfile(
        test_inner="""
import signal


def test_handler_installed():
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
"""
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
    assert signal.getsignal(signal.SIGTERM) is before


def _bench_signals():
    """benchmarks/bench_signals.py (the measurement this test repeats a few times)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_signals.py"
    spec = importlib.util.spec_from_file_location("bench_signals", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_signals", module)  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("command", "signum", "sigint_ignored"),
    [
        # started as a shell's background job (SIGINT ignored): a kill -INT still ends it
        ("run", signal.SIGINT, True),
        ("fuzz", signal.SIGTERM, False),
    ],
    ids=["run-SIGINT", "fuzz-SIGTERM"],
)
def test_signal_to_the_cli_pid_ends_it_within_the_bound_leaving_nothing(
    tmp_path: Path, command: str, signum: int, sigint_ignored: bool
) -> None:
    bench = _bench_signals()
    trial = bench.run_trial(command, signum, str(tmp_path), 0.5, sigint_ignored)
    assert trial.returncode == 128 + signum, trial
    assert trial.seconds <= bench.BOUND_S, trial  # the promise (docs/cli.md)
    assert trial.processes == [], trial
    assert trial.leftovers == [], trial  # nothing in its TMPDIR, nothing in its cwd
