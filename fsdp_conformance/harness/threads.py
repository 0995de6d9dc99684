"""``thread`` mode: the ranks are threads of the pytest process, on torch's threaded
process group (``torch.testing._internal.distributed.multi_threaded_pg``).

[Note: per-rank RNG in threads]
torch has one default CPU generator per process: ``manual_seed`` in one rank thread would
reseed the others. So each rank owns an RNG state (torch, ``random``, numpy) and the rank threads
take turns: a rank runs Python only while it holds the *baton*; taking it installs the rank's
RNG state, giving it back saves it. A rank gives the baton back while it waits for the others
(in a collective of the threaded group, in ``new_group``'s store barrier) and when its body
ends. Code that waits for another rank outside a collective deadlocks and fails at the timeout.

[Note: isolation in thread mode]
Process-wide state is saved before a test and restored after it (``harness/isolation.py``);
the harness's collective listener is added only while the test runs. What a shared interpreter
cannot restore (modules patched by hand, signal handlers, threads left running) a test must not
change.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from fsdp_conformance._patching import patch_attribute
from fsdp_conformance.harness import collectives, isolation, wire
from fsdp_conformance.harness import rank as rank_task
from fsdp_conformance.harness.context import RankContext
from fsdp_conformance.harness.wire import ABORTED, FAILED, HUNG, PASSED, RankOutcome, RankTask

# .held: the rank thread's (baton, rank), None outside rank threads
_local = threading.local()
_BATON_KEY = "fsdp-conformance thread ranks: baton released while waiting"


class RngBaton:
    """Mutual exclusion between rank threads that swaps per-rank RNG state on hand-over
    (see [Note: per-rank RNG in threads]); a rank's first turn keeps the state it finds."""

    def __init__(self, world_size: int) -> None:
        self._lock = threading.Lock()
        # rank -> its RNG state while another rank holds the baton; None before first use
        self._states: dict[int, Any] = dict.fromkeys(range(world_size))

    def acquire(self, rank: int) -> None:
        self._lock.acquire()
        if self._states[rank] is not None:
            isolation.restore_rng(self._states[rank])

    def release(self, rank: int) -> None:
        self._states[rank] = isolation.rng_state()
        self._lock.release()


def _releasing_baton(wait: Callable[..., Any]) -> Callable[..., Any]:
    """``wait`` that gives the calling rank thread's baton back while it waits."""

    @functools.wraps(wait)
    def releasing(*args: Any, **kwargs: Any) -> Any:
        if (held := getattr(_local, "held", None)) is None:
            return wait(*args, **kwargs)
        baton, rank = held
        baton.release(rank)
        try:
            return wait(*args, **kwargs)
        finally:
            baton.acquire(rank)

    return releasing


@contextlib.contextmanager
def _patched_wait_points(mtpg: Any) -> Iterator[None]:
    """Give the baton back wherever a rank thread waits for the other ranks."""
    import torch.distributed.distributed_c10d as c10d

    records = [
        patch_attribute(owner, name, _releasing_baton, key=_BATON_KEY, written_for="torch 2.13.0")
        for owner, name in (
            (mtpg.Collective, "join"),
            (c10d, "_store_based_barrier"),
            (mtpg, "_store_based_barrier"),
        )
    ]
    try:
        yield
    finally:
        for record in records:
            record.undo()


def _install_threaded_world(mtpg: Any) -> None:
    """torch's thread-local process group world (still installed when an earlier test left a
    hung rank thread behind)."""
    import torch.distributed as dist

    if not isinstance(dist.distributed_c10d._world, mtpg.ThreadLocalWorld):
        mtpg._install_threaded_pg()
    if not hasattr(mtpg.ThreadLocalWorld, "comms"):
        # torch 2.11: destroy_process_group reads _world.comms, which its threaded world
        # lacks; threaded groups never have communicator objects
        mtpg.ThreadLocalWorld.comms = property(lambda self: [])


def run_request(request: Any, task: RankTask) -> wire.RunResult:
    """The rank backend of ``thread`` mode: ``task`` of ``request`` (a ``controller.TestRequest``)
    in rank threads."""
    call = request.function or rank_task.resolve_target(task.target)
    outcomes, mismatch = run_threaded(task, request.world_size, call, request.kwargs)
    return wire.RunResult(wire.summarize(outcomes, request.world_size, mismatch))


def run_threaded(
    task: RankTask, world_size: int, call: Callable[..., Any], values: dict[str, Any]
) -> tuple[dict[int, RankOutcome], str]:
    """Run ``task`` (``call`` with the fixture ``values``) in ``world_size`` rank threads;
    return one outcome per rank and the mismatched-collectives line ("" when none).

    A rank still running at the timeout is reported HUNG with its stack and left behind (a
    daemon) after the threaded group was told to terminate; a rank that never got its turn
    is reported ABORTED, not blamed.
    """
    import torch
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    mtpg.ProcessLocalGroup.reset()
    # per-thread registry of process group names (each rank thread has group "0")
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_world(mtpg)
    run = _ThreadedRun(task, world_size, call, values)
    threads = [
        threading.Thread(target=run.rank_thread, args=(r,), name=f"fsdp-rank-{r}", daemon=True)
        for r in range(world_size)
    ]
    snapshot = isolation.StateSnapshot.take()
    uninstall = collectives.install(mtpg.ProcessLocalGroup)
    try:
        with _patched_wait_points(mtpg):
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + task.timeout
            for thread in threads:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if hung := [r for r, t in enumerate(threads) if t.is_alive()]:
                frames = sys._current_frames()
                running = [r for r in hung if r in run.began]
                for rank in hung:
                    frame = frames.get(threads[rank].ident)
                    run.outcomes[rank] = run.hung_outcome(rank, frame, running)
                mtpg.ProcessLocalGroup.exception_handle(None)  # release collective waiters
    finally:
        uninstall()
        rank_task.run_after_test()  # before the threaded groups go (e.g. Adapter.on_test_end)
        if not any(t.is_alive() for t in threads):
            mtpg._uninstall_threaded_pg()
            mtpg.ProcessLocalGroup.reset()
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
        snapshot.restore(keep_warnings_guard=False)
    return dict(run.outcomes), collectives.mismatch(run.records())


class _ThreadedRun:
    """One test in rank threads: what the threads share, and how each rank's end reads."""

    def __init__(
        self, task: RankTask, world_size: int, call: Callable[..., Any], values: dict[str, Any]
    ) -> None:
        import torch.distributed as dist

        self.task, self.world_size, self.call, self.values = task, world_size, call, values
        self.store = dist.HashStore()
        self.baton = RngBaton(world_size)
        self.outcomes: dict[int, RankOutcome] = {}
        self.slots = {rank: collectives.CollectiveSlot.in_memory() for rank in range(world_size)}
        # ranks whose body began (they held the baton at least once)
        self.began: set[int] = set()
        # the first rank that stopped without passing
        self.first_stop: RankOutcome | None = None

    def records(self) -> dict[int, collectives.CollectiveRecord]:
        return {r: slot.read() for r, slot in self.slots.items()}

    def unmatched(self, rank: int) -> str:
        passed = {r for r, o in self.outcomes.items() if o.status == PASSED}
        return collectives.unmatched(self.records(), passed, rank)

    def rank_thread(self, rank: int) -> None:
        import torch.distributed as dist
        from torch.testing._internal.distributed import multi_threaded_pg as mtpg

        collectives.set_thread_slot(self.slots[rank])
        try:
            outcome = self._run_body(rank)
        except BaseException as exc:  # noqa: BLE001  init failure
            outcome = rank_task.classify_exception(rank, exc)
        if outcome.status == FAILED and "Test termination event occurs" in outcome.message:
            outcome = self._stopped(rank)
        elif outcome.status != PASSED:
            if self.first_stop is None:
                self.first_stop = outcome
            # wake the ranks waiting for this one in a collective
            mtpg.ProcessLocalGroup.exception_handle(None)
        self.outcomes[rank] = outcome
        collectives.set_thread_slot(None)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def _run_body(self, rank: int) -> RankOutcome:
        import torch
        import torch.distributed as dist

        task = self.task
        dist.init_process_group(
            "threaded",
            rank=rank,
            world_size=self.world_size,
            store=self.store,
            timeout=datetime.timedelta(seconds=task.timeout),
        )
        ctx = RankContext.of_task(
            task, rank=rank, world_size=self.world_size, group=dist.group.WORLD, mode="thread",
            device=torch.device("cpu"), backend="threaded", init_method="threaded://",
        )  # fmt: skip
        self.baton.acquire(rank)
        self.began.add(rank)
        _local.held = (self.baton, rank)
        try:
            return rank_task.run_task(task, ctx, self.call, self.values)
        finally:
            _local.held = None
            self.baton.release(rank)

    def _stopped(self, rank: int) -> RankOutcome:
        """The outcome of a rank whose collective the threaded group's termination ended."""
        first = self.first_stop
        where = self.slots[rank].read()
        missing = self.unmatched(rank)
        if first is None and missing:
            # the ranks that finished ended the threaded group under this one
            why = f"waiting in {where.where()}; never entered by the others: {missing}"
            return RankOutcome(rank, HUNG, message=why)
        why = "stopped because the threaded process group was terminated"
        if first is not None:
            why = f"stopped because rank {first.rank} {first.status}"
        if where.count and where.state != collectives.LEFT:
            why += f" while this rank waited in {where.where()}"
        return RankOutcome(rank, ABORTED, message=why)

    def hung_outcome(self, rank: int, frame: Any, running: list[int]) -> RankOutcome:
        """The outcome of a rank thread still running at the timeout (``frame``: its stack;
        ``running``: the ranks still in their bodies)."""
        timeout = self.task.timeout
        if rank not in self.began:
            return RankOutcome(
                rank,
                ABORTED,
                message="never started its body: rank(s) "
                f"{', '.join(map(str, running)) or '?'} kept the turn until the "
                f"timeout of {timeout:g} s (thread ranks take turns; see "
                "[Note: per-rank RNG in threads])",
            )
        stack = "".join(traceback.format_stack(frame)) if frame else "(no frame)"
        dump = f"Stack of rank thread {rank} (most recent call last):\n{stack}"
        now = self.records()
        where = now[rank]
        missing = self.unmatched(rank)
        message = f"did not finish within the timeout of {timeout:g} s"
        outside = [r for r in running if not now[r].inside]
        if where.inside and outside:
            message = (
                f"waiting {where.describe()} for rank(s) "
                f"{', '.join(map(str, outside))}, which {message}"
            )
        elif where.inside:
            message += f" ({where.describe()})"
        if missing:
            message += f"; never entered by the others: {missing}"
        return RankOutcome(rank, HUNG, message=message, traceback=dump)
