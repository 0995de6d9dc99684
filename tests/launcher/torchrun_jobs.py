"""Helpers of the launcher-mode tests: torchrun jobs in subprocesses, each in its own session
(so that leftovers can be found and nothing outlives a test), free ports found at run time."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from xml.etree import ElementTree

import psutil
import pytest

# Upper bound on one torchrun job here (start-up is ~10 s on a loaded 2-core host)
JOB_TIMEOUT_S = 300


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(tmp_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an inner run: no outer pytest-xdist / launcher variables."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_TEST", "FSDP_CONFORMANCE_"))
        and key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", **(extra or {}))
    return env


@dataclasses.dataclass
class Agent:
    """One finished torchrun agent (or plain pytest) process."""

    returncode: int
    output: str
    # seconds from start to exit
    elapsed: float
    # process-group id: every process it started belongs to it
    pgid: int


def start(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(process: subprocess.Popen, started: float, timeout: float = JOB_TIMEOUT_S) -> Agent:
    """Wait for ``process``; on timeout kill its whole session and fail the test."""
    try:
        output, _ = process.communicate(timeout=max(timeout - (time.monotonic() - started), 1))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"job did not end within {timeout} s:\n{output[-4000:]}")
    return Agent(process.returncode, output, time.monotonic() - started, process.pid)


def torchrun(
    pytest_args: list[str],
    cwd: Path,
    *,
    nnodes: int = 1,
    nproc: int = 2,
    env: dict[str, str] | None = None,
) -> list[Agent]:
    """Run ``torchrun ... -m pytest PYTEST_ARGS``: one agent (``--standalone``) for one node,
    else ``nnodes`` agents on localhost with a c10d rendezvous on a free port."""
    base = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}"]  # fmt: skip
    if nnodes == 1:
        base.append("--standalone")
    else:
        base += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    command = base + ["-m", "pytest", "-p", "no:cacheprovider", *pytest_args]
    environment = clean_env(cwd, env)
    started = time.monotonic()
    processes = [start(command, cwd, environment) for _ in range(nnodes)]
    return [finish(process, started) for process in processes]


def leftovers(agents: list[Agent]) -> list[psutil.Process]:
    """Processes still alive in the agents' sessions."""
    sessions = {agent.pgid for agent in agents}
    alive = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) in sessions and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return alive


def junit_outcomes(path: Path) -> dict[str, tuple[str, str]]:
    """test name -> (passed | failed | skipped, message) from a JUnit XML file."""
    outcomes = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                # the element text first: pytest >= 9.2 shortens the message attribute of a
                # long report ("[+N more lines; full report in element text]")
                message = (element.text or "") + "\n" + (element.get("message") or "")
        outcomes[name] = (outcome, message)
    return outcomes
