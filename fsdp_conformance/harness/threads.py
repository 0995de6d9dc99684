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
import pathlib
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
        held = getattr(_local, "held", None)
        if held is None:
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


class ThreadRanks:
    """The rank backend of ``thread`` mode."""

    def run(self, request: Any, task: RankTask) -> wire.RunResult:
        call = request.function or rank_task.resolve_target(task.target)
        outcomes, mismatch = run_threaded(task, request.world_size, call, request.kwargs)
        return wire.RunResult(wire.summarize(outcomes, request.world_size, mismatch))

    def close(self) -> None:
        pass


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
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    timeout = task.timeout
    mtpg.ProcessLocalGroup.reset()
    # per-thread registry of process group names (each rank thread has group "0")
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_world(mtpg)
    store = dist.HashStore()
    baton = RngBaton(world_size)
    outcomes: dict[int, RankOutcome] = {}
    slots = {rank: collectives.CollectiveSlot.in_memory() for rank in range(world_size)}
    # ranks whose body began (they held the baton at least once)
    began: set[int] = set()
    # the first rank that stopped without passing
    first_stop: list[RankOutcome] = []

    def records() -> dict[int, collectives.CollectiveRecord]:
        return {r: slot.read() for r, slot in slots.items()}

    def unmatched(rank: int) -> str:
        passed = {r for r, o in outcomes.items() if o.status == PASSED}
        return collectives.unmatched(records(), passed, rank)

    def rank_thread(rank: int) -> None:
        collectives.set_thread_slot(slots[rank])
        try:
            dist.init_process_group(
                "threaded",
                rank=rank,
                world_size=world_size,
                store=store,
                timeout=datetime.timedelta(seconds=timeout),
            )
            ctx = RankContext(
                rank=rank,
                world_size=world_size,
                group=dist.group.WORLD,
                device=torch.device("cpu"),
                backend="threaded",
                tmp_path=pathlib.Path(task.tmp_path),
                impl=task.impl,
                mode="thread",
                test_id=task.test_id,
                init_method="threaded://",
            )
            baton.acquire(rank)
            began.add(rank)
            _local.held = (baton, rank)
            try:
                outcome = rank_task.run_task(task, ctx, call, values)
            finally:
                _local.held = None
                baton.release(rank)
        except BaseException as exc:  # noqa: BLE001  init failure
            outcome = rank_task.classify_exception(rank, exc)
        if outcome.status == FAILED and "Test termination event occurs" in outcome.message:
            first = first_stop[0] if first_stop else None
            where = slots[rank].read()
            missing = unmatched(rank)
            if first is None and missing:
                # the ranks that finished ended the threaded group under this one
                why = f"waiting in {where.where()}; never entered by the others: {missing}"
                outcome = RankOutcome(rank, HUNG, message=why)
            else:
                why = (
                    f"stopped because rank {first.rank} {first.status}"
                    if first is not None
                    else "stopped because the threaded process group was terminated"
                )
                if where.count and where.state != collectives.LEFT:
                    why += f" while this rank waited in {where.where()}"
                outcome = RankOutcome(rank, ABORTED, message=why)
        elif outcome.status != PASSED:
            if not first_stop:
                first_stop.append(outcome)
            # wake the ranks waiting for this one in a collective
            mtpg.ProcessLocalGroup.exception_handle(None)
        outcomes[rank] = outcome
        collectives.set_thread_slot(None)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    threads = [
        threading.Thread(target=rank_thread, args=(r,), name=f"fsdp-rank-{r}", daemon=True)
        for r in range(world_size)
    ]
    snapshot = isolation.StateSnapshot.take()
    uninstall = collectives.install(mtpg.ProcessLocalGroup)
    try:
        with _patched_wait_points(mtpg):
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + timeout
            for thread in threads:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
            hung = [r for r, t in enumerate(threads) if t.is_alive()]
            if hung:
                frames = sys._current_frames()
                running = [r for r in hung if r in began]
                for rank in hung:
                    frame = frames.get(threads[rank].ident)
                    stack = "".join(traceback.format_stack(frame)) if frame else "(no frame)"
                    dump = f"Stack of rank thread {rank} (most recent call last):\n{stack}"
                    if rank not in began:
                        outcomes[rank] = RankOutcome(
                            rank,
                            ABORTED,
                            message="never started its body: rank(s) "
                            f"{', '.join(map(str, running)) or '?'} kept the turn until the "
                            f"timeout of {timeout:g} s (thread ranks take turns; see "
                            "[Note: per-rank RNG in threads])",
                        )
                        continue
                    now = records()
                    where = now[rank]
                    missing = unmatched(rank)
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
                    outcomes[rank] = RankOutcome(rank, HUNG, message=message, traceback=dump)
                mtpg.ProcessLocalGroup.exception_handle(None)  # release collective waiters
    finally:
        uninstall()
        rank_task.run_after_test()  # before the threaded groups go (e.g. Adapter.on_test_end)
        if not any(t.is_alive() for t in threads):
            mtpg._uninstall_threaded_pg()
            mtpg.ProcessLocalGroup.reset()
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
        snapshot.restore(keep_warnings_guard=False)
    return dict(outcomes), collectives.mismatch(records())
