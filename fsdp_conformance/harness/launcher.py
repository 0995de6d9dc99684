"""Launcher mode: the pytest session is one process of a ``torchrun`` job and every ``dist`` test
runs in place, SPMD, in every process of the job (:class:`TorchrunRanks`, the rank backend;
:class:`LauncherPlugin`, its pytest hooks). Outside test bodies the ranks talk only through the
launcher's key-value store, every wait with a deadline (docs/torchrun.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import hashlib
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any

import pytest

from fsdp_conformance import constants
from fsdp_conformance.harness import gpus, wire
from fsdp_conformance.harness import rank as rank_task
from fsdp_conformance.harness.wire import DIED, FAILED, HUNG, SKIPPED, RankOutcome, RankTask

# What torchrun sets in every process it starts.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Seconds a rank waits, beyond a test's timeout, for the others' outcomes / rank 0's status.
OUTCOME_GRACE_S = 5.0


@dataclasses.dataclass(frozen=True)
class LauncherEnv:
    """This process's place in the launcher's job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def _int_env(name: str, default: str | None = None) -> int:
    text = os.environ.get(name, default)
    try:
        return int(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise pytest.UsageError(
            f"launcher environment: {name}={text!r} is not an integer; start pytest under "
            "torchrun, or pass --fsdp-launcher none"
        ) from None


def detect(choice: str) -> LauncherEnv | None:
    """This process's :class:`LauncherEnv` when pytest runs inside a launcher, else None
    (``choice``: ``auto``, ``torchrun``: required, or ``none``)."""
    if choice not in constants.LAUNCHERS:
        launchers, env = ", ".join(constants.LAUNCHERS), constants.ENV_LAUNCHER
        raise pytest.UsageError(f"--fsdp-launcher {choice!r}: use one of {launchers} (env {env})")
    if choice == "none":
        return None
    # torch is imported only when it already is (the plugin stays import-light)
    tdist = sys.modules.get("torch.distributed")
    if tdist is not None and tdist.is_available() and tdist.is_initialized():
        rank, size = tdist.get_rank(), tdist.get_world_size()
        local = _int_env("LOCAL_RANK", str(rank)), _int_env("LOCAL_WORLD_SIZE", str(size))
        return LauncherEnv(rank, size, *local)
    if missing := [name for name in LAUNCHER_ENV if name not in os.environ]:
        if choice == "torchrun":
            raise pytest.UsageError(
                f"--fsdp-launcher torchrun: {', '.join(missing)} not set; start pytest with "
                "`torchrun ... -m pytest`, or use --fsdp-launcher auto"
            )
        return None
    rank, world_size = _int_env("RANK"), _int_env("WORLD_SIZE")
    if not 0 <= rank < world_size:
        raise pytest.UsageError(
            f"launcher environment: RANK={rank} is not in [0, WORLD_SIZE={world_size}); fix the "
            "launcher's environment, or pass --fsdp-launcher none"
        )
    local = _int_env("LOCAL_RANK"), _int_env("LOCAL_WORLD_SIZE", str(world_size))
    return LauncherEnv(rank, world_size, *local)


class _Timeout(BaseException):
    """Raised in the test body by the watchdog's signal."""


class _Watchdog:
    """After ``timeout`` seconds: posts the body's stack dump as its outcome and interrupts it
    (SIGUSR2); ends the process when the body still does not return (docs/torchrun.md)."""

    def __init__(self, runtime: TorchrunRanks, key: str, size: int, timeout: float) -> None:
        self.runtime = runtime
        self.key = key
        self.size = size
        self.timeout = timeout
        self.fired = False
        self.dump = ""
        self._lock = threading.Lock()
        self._done = threading.Event()  # set (under the lock) when the body returned
        self._main = threading.get_ident() == threading.main_thread().ident
        self._thread = threading.Thread(target=self._watch, daemon=True, name="fsdp-watchdog")

    def __enter__(self) -> _Watchdog:  # noqa: PYI034
        self.runtime._watchdog = self
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._done.set()
        self.runtime._watchdog = None

    def on_signal(self) -> None:
        with self._lock:
            if self.fired and not self._done.is_set():
                raise _Timeout

    def _watch(self) -> None:
        if self._done.wait(self.timeout):
            return
        with tempfile.TemporaryFile("w+") as stream:
            faulthandler.dump_traceback(stream, all_threads=True)
            stream.seek(0)
            dump = stream.read()
        with self._lock:
            if self._done.is_set():
                return
            self.dump = dump
            self.fired = True
        self.runtime._post(self.key, _hung(self.runtime.env.rank, self.timeout, dump))
        if self._main:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)
        if not self._done.wait(self.timeout + OUTCOME_GRACE_S):
            self.runtime._give_up(self.key, self.size)


_NO_OUTCOME = (
    f"sent no outcome within the timeout + {OUTCOME_GRACE_S:g} s (the process ended, or is "
    "stuck where the watchdog cannot interrupt it)"
)


def _hung(rank: int, timeout: float, dump: str) -> RankOutcome:
    message = f"did not finish within the timeout of {timeout:g} s"
    return RankOutcome(rank, HUNG, message=message, traceback=dump)


class TorchrunRanks:
    """The rank backend of launcher mode: runs each test in place in this process, in step
    with the job's other processes (``options``: the session's ``RuntimeOptions``)."""

    def __init__(self, options: Any, env: LauncherEnv) -> None:
        self.options = options
        self.env = env
        rank_task.add_after_test(options.after_test)
        # why the session must stop (a hang or a gone rank), None while healthy
        self.broken: str | None = None
        self._started = False
        self._store: Any = None
        self._root = ""
        self._backend = ""
        self._device: Any = None
        self._gpu_count = 0  # on this node
        self._owns_group = False
        self._occurrences: dict[str, int] = {}
        # ranks that sent no outcome in time (not waited for again)
        self._gone: set[int] = set()
        self._watchdog: _Watchdog | None = None
        self._previous_handler: Any = None

    def start(self) -> None:
        """Join (or create) the default process group and the session's shared directory."""
        if self._started:
            return
        import torch
        import torch.distributed as tdist

        self._started = True
        count = self._gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        default = "nccl" if count >= self.env.local_world_size and count > 0 else "gloo"
        self._backend = self.options.backend or default
        self._device = torch.device("cpu")
        if self._backend == "nccl":
            self._device = torch.device("cuda", self.env.local_rank)
            torch.cuda.set_device(self._device)
        if not tdist.is_initialized():
            tdist.init_process_group(
                backend=self._backend,
                init_method="env://",
                timeout=datetime.timedelta(seconds=self.options.timeout),
                **({"device_id": self._device} if self._backend == "nccl" else {}),
            )
            self._owns_group = True
        else:
            self._backend = tdist.get_backend()
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._store = tdist.PrefixStore(
            f"fsdp-conformance/{restart}/", tdist.distributed_c10d._get_default_store()
        )
        if self.env.rank == 0:
            self._root = tempfile.mkdtemp(prefix="fsdp-conformance-")
            self._store.set("root", self._root)
        else:
            self._wait(["root"], self.options.timeout)
            self._root = self._store.get("root").decode()
            os.makedirs(self._root, exist_ok=True)
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGUSR2, self._on_signal)

    def close(self) -> None:
        """Leave the job: wait (bounded) until every rank is done with the store, then
        destroy the process group (when this session created it and it is healthy)."""
        if not self._started:
            return
        import torch.distributed as tdist

        self._started = False
        if self._previous_handler is not None:
            signal.signal(signal.SIGUSR2, self._previous_handler)
            self._previous_handler = None
        if self.broken is None and self._owns_group and tdist.is_initialized():
            tdist.destroy_process_group()  # (the store object stays usable)
        with contextlib.suppress(Exception):  # the store's host ended: nobody waits for this
            self._post("closed", self.env.rank)
        if self.env.rank == 0:
            # leave last: the launcher stops the others when rank 0 exits non-zero
            alive = [r for r in range(self.env.world_size) if r not in self._gone]
            self._missing([f"closed/{r}" for r in alive], OUTCOME_GRACE_S)
        if self.env.local_rank == 0:
            shutil.rmtree(self._root, ignore_errors=True)

    def _post(self, key: str, value: Any) -> None:
        self._store.set(f"{key}/{self.env.rank}", pickle.dumps(value))

    def _wait(self, keys: list[str], seconds: float) -> None:
        self._store.wait(keys, datetime.timedelta(seconds=max(seconds, 0.001)))

    def _missing(self, keys: list[str], seconds: float) -> list[str]:
        """Wait until ``keys`` exist or ``seconds`` passed; return the keys still missing
        (all of them when the store itself is gone)."""
        try:
            self._wait(keys, seconds)
        except Exception:  # noqa: BLE001  (the store's timeout error type varies by version)
            try:
                return [key for key in keys if not self._store.check([key])]
            except Exception:  # noqa: BLE001  the store's host ended
                return list(keys)
        return []

    def _read(self, key: str) -> Any:
        """The value posted under ``key``, or None when the store cannot give it."""
        try:
            return pickle.loads(self._store.get(key))
        except Exception:  # noqa: BLE001  the store's host ended
            return None

    def _gather(self, key: str, ranks: int, deadline: float) -> dict[int, RankOutcome]:
        keys = [f"{key}/{rank}" for rank in range(ranks)]
        missing = set(self._missing(keys, deadline - time.monotonic()))
        outcomes = {}
        for rank, name in enumerate(keys):
            outcome = None if name in missing else self._read(name)
            if outcome is None:
                self._gone.add(rank)
                outcome = RankOutcome(rank, DIED, message=_NO_OUTCOME)
            outcomes[rank] = outcome
        return outcomes

    def run(self, request: Any, task: RankTask) -> wire.RunResult:
        """Run ``task`` (of ``request``, a ``controller.TestRequest``) in place; every rank of
        the job calls this for the same test."""
        self.start()
        size, jobs = request.world_size, self.env.world_size
        if size < 1:
            return wire.not_run(FAILED, f"world_size must be >= 1, got {size}")
        if size > jobs:
            return wire.not_run(
                SKIPPED, f"needs {size} ranks, the launcher's job has {jobs} (WORLD_SIZE)"
            )
        if request.gpus and (self._backend != "nccl" or request.gpus > jobs):
            # the spawning modes' reason; here every rank of an nccl job holds one GPU
            held = jobs if self._backend == "nccl" else 0
            where = " (CPU-only host)" if self._gpu_count == 0 else " (gloo job)"
            return wire.not_run(SKIPPED, gpus.shortage(request.gpus, held, where))
        if self.broken is not None:
            return wire.not_run(FAILED, f"not run: {self.broken}")
        occurrence = self._occurrences.get(request.test_id, 0)
        self._occurrences[request.test_id] = occurrence + 1
        key = f"test/{request.test_id}#{occurrence}"
        tmp_path = os.path.join(self._root, hashlib.sha1(key.encode()).hexdigest()[:16])
        os.makedirs(tmp_path, exist_ok=True)
        deadline = time.monotonic() + request.timeout + OUTCOME_GRACE_S
        if self.env.rank < size:
            task = dataclasses.replace(task, tmp_path=tmp_path)
            self._post(key, self._run_body(request, task, size, key))
        outcomes = self._gather(key, size, deadline)
        if self.env.local_rank == 0:
            shutil.rmtree(tmp_path, ignore_errors=True)
        if gone := [o.rank for o in outcomes.values() if o.status in (DIED, HUNG)]:
            self.broken = (
                f"rank(s) {', '.join(map(str, gone))} hung or ended in {request.test_id}; the "
                "process group cannot be trusted after that, so the session stopped"
            )
        return wire.RunResult(wire.summarize(outcomes, size))

    def _run_body(self, request: Any, task: RankTask, size: int, key: str) -> RankOutcome:
        import torch.distributed as tdist

        from fsdp_conformance.harness import isolation
        from fsdp_conformance.harness.context import RankContext

        rank = self.env.rank
        try:
            if size == self.env.world_size:
                group = tdist.group.WORLD
            else:
                group = tdist.new_group(
                    list(range(size)),
                    timeout=datetime.timedelta(seconds=request.timeout),
                    use_local_synchronization=True,
                )
        except Exception as exc:  # noqa: BLE001  reported like a failure of the body
            return rank_task.classify_exception(rank, exc)
        ctx = RankContext.of_task(
            task, rank=rank, world_size=size, group=group, device=self._device,
            backend=self._backend, mode="launcher",  # run in place
            gpu_ids=(self._device.index,) if self._backend == "nccl" else (), init_method="env://",
        )  # fmt: skip
        watchdog = _Watchdog(self, key, size, request.timeout)
        job_group = tdist.group.WORLD
        snapshot = isolation.StateSnapshot.take()
        try:
            with watchdog:
                # the test's group is the default group while its body runs
                tdist.GroupMember.WORLD = group
                call = request.function or rank_task.resolve_target(task.target)
                outcome = rank_task.run_task(task, ctx, call, request.kwargs)
        except _Timeout:
            outcome = RankOutcome(rank, FAILED)
        finally:
            tdist.GroupMember.WORLD = job_group
        if watchdog.fired:
            outcome = _hung(rank, request.timeout, watchdog.dump)
        try:
            for problem in rank_task.reset_after_test(snapshot, [], rank):
                sys.stderr.write(f"fsdp-conformance: {request.test_id}: {problem}\n")
        except BaseException as exc:  # noqa: BLE001  a broken reset poisons later tests
            self.broken = f"rank {rank} could not reset after {request.test_id}: {exc!r}"
        return outcome

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._watchdog is not None:
            self._watchdog.on_signal()

    def _give_up(self, key: str, size: int) -> None:
        """The body did not return after the watchdog's signal: report and end the process."""
        head = (
            f"fsdp-conformance: rank {self.env.rank}: {key.removeprefix('test/')} did not return "
            f"{self.options.timeout:g} s after its timeout interrupted it; ending this process"
        )
        if self.env.rank == 0:
            outcomes = self._gather(key, size, time.monotonic() + OUTCOME_GRACE_S)
            head += "\n" + wire.summarize(outcomes, size).message
        sys.stderr.write(head + "\n")
        sys.stderr.flush()
        os._exit(1)


class LauncherPlugin:
    """pytest hooks of launcher mode (registered by the plugin when :func:`detect` finds a
    launcher): quiet ranks other than 0, check the collection, agree on the exit status."""

    def __init__(self, runtime: TorchrunRanks) -> None:
        self.runtime = runtime
        self.env = runtime.env

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self._session = session
        if self.env.rank == 0:
            return
        from _pytest._io import TerminalWriter

        if (reporter := session.config.pluginmanager.get_plugin("terminalreporter")) is not None:
            devnull = open(os.devnull, "w")  # noqa: SIM115  (closed with the session)
            session.config.add_cleanup(devnull.close)
            reporter._tw = TerminalWriter(devnull)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, items: list[Any]) -> None:
        runtime = self.runtime
        runtime.start()
        runtime._post("collected", [item.nodeid for item in items])
        keys = [f"collected/{rank}" for rank in range(self.env.world_size)]
        if missing := runtime._missing(keys, runtime.options.timeout):
            ranks = ", ".join(key.rpartition("/")[2] for key in missing)
            runtime.broken = f"rank(s) {ranks} did not finish collecting"
            raise pytest.UsageError(
                f"launcher mode: rank(s) {ranks} did not report their collected tests within "
                f"{runtime.options.timeout:g} s (--fsdp-timeout)"
            )
        collected = [runtime._read(key) or [] for key in keys]
        reference = collected[0]
        other = next((r for r, ids in enumerate(collected) if ids != reference), None)
        if other is None:
            return
        # every rank fails the session, with the first rank that differs from rank 0
        theirs = collected[other]
        only_there = sorted(set(theirs) - set(reference))[:10]
        only_zero = sorted(set(reference) - set(theirs))[:10]
        runtime.broken = "the ranks collected different tests"
        raise pytest.UsageError(
            f"launcher mode: rank {other} collected {len(theirs)} tests, rank 0 collected "
            f"{len(reference)}; every rank must collect the same tests in the same order (same "
            f"-k, files and options on every node). Only on rank {other}: "
            f"{only_there or 'none'}; only on rank 0: {only_zero or 'none'}"
            + ("; same tests in another order" if not only_there and not only_zero else "")
        )

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        session = getattr(self, "_session", None)
        if self.runtime.broken is not None and session is not None:
            session.shouldfail = self.runtime.broken

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        runtime = self.runtime
        if not runtime._started:
            return
        if self.env.rank == 0:
            runtime._post("exit", int(exitstatus))
            return
        wait = OUTCOME_GRACE_S + (runtime.options.timeout if runtime.broken is None else 0)
        reported = 0 not in runtime._gone and not runtime._missing(["exit/0"], wait)
        status = runtime._read("exit/0") if reported else None
        if status is None:
            sys.stderr.write(
                f"fsdp-conformance: rank {self.env.rank}: rank 0 reported no exit status "
                f"within {wait:g} s; exiting with 1\n"
            )
            status = max(int(exitstatus), 1)
        session.exitstatus = status


def configure(config: pytest.Config, choice: str) -> LauncherEnv | None:
    """:func:`detect` the launcher; on ranks other than 0 turn off ``--junitxml`` and the CLI's
    result file before their plugins start."""
    if (env := detect(choice)) is not None and env.rank != 0:
        config.option.xmlpath = None
        os.environ.pop("FSDP_CONFORMANCE_CLI_RESULTS", None)
    return env
