"""Entry point of a rank process (``process`` and ``process-fresh`` modes).

Started by :class:`fsdp_conformance.world.procs.RankSet` as
``python -c "from fsdp_conformance.world.rank_main import main; main()"`` with the
parent connection's file descriptor and the rank's coordinates in the environment.

[Note: leaving a rank]
A rank leaves with ``os._exit`` after flushing its output and sending its last message:
ranks sometimes abort during interpreter-exit garbage collection after
``destroy_process_group`` ("THPVariable_clear INTERNAL ASSERT", "terminate called without
an active exception"), which would turn a passing test into a crash report.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from fsdp_conformance import vocab
from fsdp_conformance.world import hooks
from fsdp_conformance.world.protocol import (
    Exit,
    Finished,
    GroupReinitialized,
    Ready,
    ReinitGroup,
    RunTest,
    Started,
    StartupFailed,
    expect,
)

# Environment variables the parent sets for a rank process.
ENV_FD = "FSDP_CONFORMANCE_CONN_FD"
ENV_RANK = "FSDP_CONFORMANCE_RANK"
ENV_WORLD_SIZE = "FSDP_CONFORMANCE_WORLD_SIZE"
ENV_STORE = "FSDP_CONFORMANCE_STORE"
ENV_BACKEND = "FSDP_CONFORMANCE_RANK_BACKEND"
ENV_GPU_IDS = "FSDP_CONFORMANCE_RANK_GPUS"
ENV_TIMEOUT = "FSDP_CONFORMANCE_RANK_TIMEOUT"
ENV_MODE = "FSDP_CONFORMANCE_RANK_MODE"
ENV_FAKE_GPUS = vocab.ENV_FAKE_GPUS
ENV_COLLECTIVE_SLOT = "FSDP_CONFORMANCE_COLLECTIVE_SLOT"

# Seconds between checks that the parent is still alive (an orphaned rank exits).
PARENT_POLL_S = 0.5


def _leave(code: int) -> None:
    """Flush and leave without interpreter teardown; see [Note: leaving a rank]."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110  (a closed stream must not stop the exit)
            pass
    os._exit(code)


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            _leave(70)


class _RankProcess:
    """State of one rank process across the tests it runs."""

    def __init__(self) -> None:
        # - Coordinates (fixed for the process lifetime)
        self.rank = int(os.environ[ENV_RANK])
        self.world_size = int(os.environ[ENV_WORLD_SIZE])
        self.backend = os.environ[ENV_BACKEND]
        self.mode = os.environ.get(ENV_MODE, "process")
        gpu_text = os.environ.get(ENV_GPU_IDS, "")
        # GPUs held by the rank set, one per rank, () on CPU
        self.gpu_ids = tuple(int(g) for g in gpu_text.split(",") if g)
        self.timeout = float(os.environ.get(ENV_TIMEOUT, str(vocab.DEFAULT_TIMEOUT_S)))
        self.store_path = os.environ[ENV_STORE]
        # - Connection to the parent
        self.conn = Connection(int(os.environ[ENV_FD]))
        # - Process-global state restored after every test
        self.base_environ: dict[str, str] = {}
        self.base_sys_path: list[str] = list(sys.path)
        # saved after start-up, restored after every test (world/isolation.py)
        self.snapshot: Any = None
        # monkeypatch fixtures made for the running test (undone after it)
        self.monkeypatches: list[Any] = []

    def start(self) -> None:
        import torch
        import torch.distributed as dist

        from fsdp_conformance.world import collectives, isolation

        _preload()
        if self.backend == "nccl":
            torch.cuda.set_device(self.gpu_ids[self.rank])
            device = torch.device("cuda", self.gpu_ids[self.rank])
        else:
            device = torch.device("cpu")
        self.device = device
        # kept for re-creating the default group after a test destroyed it
        self.store = dist.FileStore(self.store_path, self.world_size)
        self._init_group(self.store)
        slot_path = os.environ.get(ENV_COLLECTIVE_SLOT)
        if slot_path:
            self.slot = collectives.CollectiveSlot.mapped(slot_path)
            collectives.set_process_slot(self.slot)
            collectives.install()
        else:
            self.slot = None
        self.base_environ = dict(os.environ)
        self.snapshot = isolation.StateSnapshot.take()

    def _init_group(self, store: Any) -> None:
        import torch.distributed as dist

        dist.init_process_group(
            backend=self.backend,
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=self.timeout),
            **({"device_id": self.device} if self.backend == "nccl" else {}),
        )
        self.group = dist.group.WORLD
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def reinit_group(self, generation: int) -> None:
        """Initialise a new default process group (the test destroyed the old one)."""
        import torch.distributed as dist

        self._init_group(dist.PrefixStore(f"reinit{generation}/", self.store))

    # - One test

    def run(self, task: Any) -> Any:
        import pathlib

        from fsdp_conformance.world import execute
        from fsdp_conformance.world.context import RankContext

        self._enter(task)
        hooks.add_after_test(task.after_test)
        ctx = RankContext(
            rank=self.rank,
            world_size=self.world_size,
            group=self.group,
            device=self.device,
            backend=self.backend,
            tmp_path=pathlib.Path(task.tmp_path),
            impl=task.impl,
            mode=self.mode,
            gpu_ids=self.gpu_ids,
            test_id=task.test_id,
            init_method=f"file://{self.store_path}",
        )

        # Importing the test module is start-up, not test time: the parent starts the
        # test's timeout once every rank reported "started".
        try:
            call = execute.resolve_target(task.target)
            values = pickle.loads(task.kwargs_blob)
        except BaseException as exc:  # noqa: BLE001  reported like a failure of the body
            return execute.classify_exception(self.rank, exc)
        self.conn.send(Started())
        if self.slot is not None:
            self.slot.reset()

        def body() -> None:
            if task.target.kind == "unittest":
                _current_context.ctx = ctx
                try:
                    call()
                finally:
                    _current_context.ctx = None
            else:
                call(**execute.build_kwargs(values, ctx, task.wants_dist, self.monkeypatches))

        execute.seed_all(task.seed)
        return execute.call_and_classify(self.rank, body)

    def _enter(self, task: Any) -> None:
        os.environ.clear()
        os.environ.update(task.environ)
        for key in (ENV_RANK, ENV_WORLD_SIZE, ENV_BACKEND, ENV_GPU_IDS, ENV_MODE):
            os.environ[key] = self.base_environ.get(key, "")
        os.environ["RANK"] = str(self.rank)
        os.environ["LOCAL_RANK"] = str(self.rank)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        sys.path[:] = list(task.sys_path) + [
            p for p in self.base_sys_path if p not in task.sys_path
        ]
        try:
            os.chdir(task.cwd)
        except OSError:
            pass

    def reset(self) -> list[str]:
        """Undo what the test left (:func:`reset_after_test` with this rank's snapshot).

        Returns:
            what could not be undone, one line each (the parent then replaces the rank set).
        """
        return reset_after_test(self.snapshot, self.monkeypatches, self.rank)


def reset_after_test(snapshot: Any, monkeypatches: list[Any], rank: int) -> list[str]:
    """Undo what a test left in this interpreter: its monkeypatches, process groups other than
    the default one, and everything in ``snapshot`` (world/isolation.py).

    Args:
        snapshot: the ``isolation.StateSnapshot`` to restore.
        monkeypatches: the test's rank-side monkeypatch objects (emptied, each undone).
        rank: this rank, for the message.

    Returns:
        what could not be undone, one line each (the caller then replaces the rank set).
    """
    import torch.distributed as dist

    from fsdp_conformance.world import isolation

    hooks.run_after_test()
    while monkeypatches:
        monkeypatches.pop().undo()
    if dist.is_initialized():
        world = dist.distributed_c10d._world
        for group in list(world.pg_map):
            if group is not world.default_pg:
                dist.destroy_process_group(group)
    snapshot.restore()
    left = isolation.leftover_threads(snapshot)
    if left:
        return [f"the test left thread(s) running in rank {rank}: {', '.join(left)}"]
    return []


def _preload() -> None:
    """Import now what every first test would import, so it does not count against the
    first test's timeout."""
    import unittest  # noqa: F401

    import _pytest.assertion.rewrite
    import _pytest.outcomes  # noqa: F401

    import fsdp_conformance.world.execute  # noqa: F401

    try:
        import numpy  # noqa: F401
    except ImportError:
        pass


class _CurrentContext(threading.local):
    ctx: Any = None


# The rank context of the test running in this process/thread (FSDPTest reads it).
_current_context = _CurrentContext()


# This process's rank state (None outside rank processes).
_process: _RankProcess | None = None


def current_context() -> Any:
    """The :class:`RankContext` of the test running in this rank, or None."""
    return _current_context.ctx


def main() -> None:
    """Rank process main loop: initialise, then run tests until told to exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills us
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's hang dump
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    global _process
    process = _process = _RankProcess()
    try:
        process.start()
    except BaseException:  # noqa: BLE001
        process.conn.send(StartupFailed(traceback.format_exc()))
        _leave(1)
    process.conn.send(Ready(os.getpid()))
    while True:
        try:
            message = process.conn.recv()
        except (EOFError, OSError):
            _leave(0)
        message = expect(message, "the parent", RunTest, ReinitGroup, Exit)
        if isinstance(message, Exit):
            _leave(0)
        if isinstance(message, ReinitGroup):
            try:
                process.reinit_group(message.generation)
                error = ""
            except BaseException:  # noqa: BLE001  reported; the parent replaces the set
                error = traceback.format_exc()
            process.conn.send(GroupReinitialized(error))
            if error:
                _leave(72)
            continue
        task = pickle.loads(message.task_blob)
        outcome = process.run(task)
        try:
            notes = tuple(process.reset())
            reusable = not notes
        except BaseException:  # noqa: BLE001  a broken reset would poison the next test
            traceback.print_exc()
            notes = (f"rank {process.rank} could not restore its state after the test",)
            reusable = False
        sys.stdout.flush()
        sys.stderr.flush()
        import torch.distributed as dist

        process.conn.send(Finished(outcome, reusable, dist.is_initialized(), notes))
        if not reusable:
            _leave(71)
