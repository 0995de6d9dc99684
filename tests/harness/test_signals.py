"""Signal-safe cleanup: SIGTERM to pytest (a CI cancel, ``timeout``) ends the session like
Ctrl-C, so that no rank process and no temp directory is left; SIGTERM to
``fsdp-conformance run`` is forwarded to its pytest child, which is never left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
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


def _cli_pytest_child(cli: subprocess.Popen) -> psutil.Process | None:
    try:
        for child in psutil.Process(cli.pid).children():
            if "pytest" in " ".join(child.cmdline()):
                return child
    except psutil.NoSuchProcess:
        pass
    return None


def test_sigterm_to_cli_run_stops_its_pytest_child(tmp_path, private_tmpdir) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    cli = subprocess.Popen(
        [sys.executable, "-m", "fsdp_conformance.cli", "run", "-n", "0", "--timeout", "60"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    child = None
    try:
        assert _wait_for(lambda: _cli_pytest_child(cli) is not None, START_WAIT_S)
        child = _cli_pytest_child(cli)
        time.sleep(1)  # let the child install its handlers
        cli.send_signal(signal.SIGTERM)
        _, stderr = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 128 + signal.SIGTERM, stderr
    assert "interrupted" in stderr
    assert child is not None
    assert _wait_for(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 5)
    assert _wait_for(lambda: runtime_files(private_tmpdir) == [], 5)
