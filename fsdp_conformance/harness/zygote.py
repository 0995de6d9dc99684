"""The zygote: one process per controller that imports torch once and forks the rank processes,
so that a rank starts in a fork (milliseconds) instead of a fresh interpreter importing torch
(~1.2 CPU-seconds each; a conformance run starts about twenty).

The controller sends ``(environment, cwd, log path)`` and the rank's end of its socket over a
``SOCK_SEQPACKET`` pair; the zygote forks, the child becomes a rank process exactly as
``python -c "...rank import main; main()"`` would (own session, stdin from /dev/null, output
into the log, the given environment and cwd), and the zygote answers with its pid. The zygote
reaps its children and reports each exit code, which :class:`ForkedProcess` reads with the
``poll``/``wait``/``pid`` surface of :class:`subprocess.Popen` that the rank set uses.

Before forking, the zygote also imports the modules :func:`preload` named (the plugin names the
installed suite's test modules: every rank of a conformance run imports them) and freezes the
garbage collector's view of everything imported, so that no rank's collection walks (and so
copies) the zygote's objects.

One zygote serves every spawn whose import-time environment (``PYTHON*``, ``OMP_*``, ``MKL_*``,
``KMP_*``, ``TORCH*``, ``LD_*``) matches its own; any other environment gets a zygote of its
own. It exits when the controller's end of the socket closes (the controller exited), and its
ranks then see their parent change and exit too.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

ENV_FD = "FSDP_CONFORMANCE_ZYGOTE_FD"
ENV_PRELOAD = "FSDP_CONFORMANCE_ZYGOTE_PRELOAD"
# environment variables read when the interpreter or torch starts: a zygote is reused only
# for spawns that agree with it on these
_IMPORT_TIME = ("PYTHON", "OMP_", "MKL_", "KMP_", "TORCH", "LD_")
_MAX_MESSAGE = 1 << 22
_REAP_S = 0.02
# the longest a spawn waits for the zygote (its first one includes importing torch)
SPAWN_TIMEOUT_S = 120.0
_COMMAND = "from fsdp_conformance.harness.zygote import serve; serve()"

_zygotes: dict[tuple, Zygote] = {}
_lock = threading.Lock()
_preload: set[str] = set()


def preload(modules: list[str]) -> None:
    """Have zygotes started from now on import ``modules`` (names; fork-safe at import: no
    threads, no CUDA) before they fork a rank."""
    _preload.update(modules)


def available() -> bool:
    return sys.platform.startswith("linux") and hasattr(socket, "send_fds")


def spawn(env: dict[str, str], log_path: str, fd: int) -> ForkedProcess:
    """Fork a rank process with environment ``env``, output into ``log_path``, holding ``fd``
    (its end of the controller's socket; the rank finds its number in ``rank.ENV_FD``).
    OSError when no zygote can serve it."""
    key = (*sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_TIME)), sys.executable)
    with _lock:
        if (zygote := _zygotes.get(key)) is None or not zygote.alive():
            zygote = _zygotes[key] = Zygote(env)
    return zygote.spawn(env, log_path, fd)


def start_python(command: str, output: Any, fd: int, env: dict[str, str]) -> subprocess.Popen:
    """``python -c command`` holding ``fd``, in a session of its own (Ctrl-C goes to the
    controller), stdin from /dev/null, stdout and stderr into ``output``."""
    return subprocess.Popen(
        [sys.executable, "-c", command],
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT,
        pass_fds=[fd],
        env=env,
        start_new_session=True,
    )


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def close_all() -> None:
    with _lock:
        for zygote in _zygotes.values():
            zygote.close()
        _zygotes.clear()


atexit.register(close_all)


class ForkedProcess:
    """A rank forked by a zygote, seen through ``subprocess.Popen``'s ``pid``/``poll``/``wait``."""

    def __init__(self, zygote: Zygote, pid: int, serial: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.serial = serial  # the zygote's number for this child (a pid can be reused)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
        return self.returncode


class Zygote:
    """The controller's handle on one zygote process."""

    def __init__(self, env: dict[str, str]) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in env.items() if not k.startswith("FSDP_CONFORMANCE_")}
        env.update({ENV_FD: str(theirs.fileno()), ENV_PRELOAD: ",".join(sorted(_preload))})
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = start_python(_COMMAND, subprocess.DEVNULL, theirs.fileno(), env)
        theirs.close()
        self.exited: dict[int, int] = {}
        self.eof = False
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return not self.eof and self.proc.poll() is None

    def spawn(self, env: dict[str, str], log_path: str, fd: int) -> ForkedProcess:
        request = pickle.dumps((env, os.getcwd(), log_path))
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        with self.lock:
            socket.send_fds(self.sock, [request], [fd])
            while True:
                message = self._receive(max(0.0, deadline - time.monotonic()))
                if message is None and not self.eof and time.monotonic() < deadline:
                    continue
                if message is None:  # it exited, or hangs: the caller starts an interpreter
                    self.proc.kill()
                    self.eof = True
                    raise OSError(f"the zygote (pid {self.proc.pid}) exited or hangs")
                if message[0] == "spawned":
                    return ForkedProcess(self, message[1], message[2])
                if message[0] == "failed":
                    raise OSError(f"the zygote could not fork a rank: {message[1]}")

    def exit_code(self, child: ForkedProcess, timeout: float | None) -> int | None:
        """``child``'s exit code (negative: the signal), None if it still runs after
        ``timeout`` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        serial = child.serial
        with self.lock:
            while serial not in self.exited:
                if self.eof:  # the zygote died: init reaps its orphaned ranks
                    if not _exists(child.pid):
                        self.exited[serial] = -signal.SIGKILL
                        break
                    if deadline is not None and time.monotonic() >= deadline:
                        return None
                    time.sleep(_REAP_S)
                    continue
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                if self._receive(remaining) is None and remaining == 0.0:
                    return None
            return self.exited[serial]  # kept: another thread may be waiting for it too

    def _receive(self, timeout: float | None) -> tuple | None:
        """One message (exit reports are recorded on the way); None on timeout or EOF."""
        if self.eof or not select.select([self.sock], [], [], timeout)[0]:
            return None
        if not (data := self.sock.recv(_MAX_MESSAGE)):
            self.eof = True
            return None
        message = pickle.loads(data)
        if message[0] == "exit":
            self.exited[message[1]] = message[2]
        return message

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def serve() -> None:
    """The zygote process: import what every rank imports, then fork ranks on request."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(os.environ.pop(ENV_FD)))
    from fsdp_conformance.harness import rank

    rank.preimport()
    for module in filter(None, os.environ.pop(ENV_PRELOAD, "").split(",")):
        with contextlib.suppress(Exception):  # a rank imports it again and reports the error
            importlib.import_module(module)
    gc.collect()
    gc.freeze()
    children: dict[int, int] = {}  # pid -> serial
    serial = 0
    while True:
        readable = select.select([sock], [], [], _REAP_S if children else None)[0]
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            code = os.waitstatus_to_exitcode(status)
            sock.send(pickle.dumps(("exit", children.pop(pid, 0), code)))
        if not readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 1)
        if not data:
            os._exit(0)  # the controller is gone; our ranks notice their parent change
        env, cwd, log_path = pickle.loads(data)
        try:
            with warnings.catch_warnings():  # 3.12+: torch's one native thread (not ours)
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError as exc:
            pid = -1
            sock.send(pickle.dumps(("failed", str(exc))))
        if pid == 0:
            _become_rank(sock, fds[0], env, cwd, log_path)
        for fd in fds:
            os.close(fd)
        if pid < 0:
            continue
        serial += 1
        children[pid] = serial
        sock.send(pickle.dumps(("spawned", pid, serial)))


def _become_rank(sock: socket.socket, fd: int, env: dict[str, Any], cwd: str, log: str) -> None:
    code = 1
    try:
        sock.close()
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        from fsdp_conformance.harness import rank

        os.environ[rank.ENV_FD] = str(fd)
        rank.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 (reported in the rank's log, like an interpreter would)
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
