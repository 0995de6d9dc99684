"""The rank set: ``world_size`` rank processes that joined one default process group
(FileStore rendezvous in the set's private directory), seen from the controller: spawn them,
run a test in them (outcomes, output, hang and mismatch reports), tear them down.
``process`` mode reuses a set across tests; ``process-fresh`` makes one per test.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait

from fsdp_conformance.harness import collectives
from fsdp_conformance.harness import rank as rank_process
from fsdp_conformance.harness.wire import (
    ABORTED,
    DIED,
    FAILED,
    HUNG,
    PASSED,
    SKIPPED,
    Exit,
    Finished,
    GroupReinitialized,
    ProtocolError,
    RankOutcome,
    Ready,
    ReinitGroup,
    RunTest,
    Started,
    StartupFailed,
    expect,
)

# Seconds the other ranks get to finish after one rank failed, died or skipped before they are
# reported as stuck (typically blocked in a collective with the failed rank) and killed.
PEER_GRACE_S = 3.0
# Seconds to wait for a rank's faulthandler dump to be written after SIGUSR1.
DUMP_WAIT_S = 3.0
# Seconds a rank gets to exit on request before it is killed.
EXIT_WAIT_S = 2.0
# Least seconds a rank set gets to start (import torch, rendezvous): start-up is not part of a
# test's --fsdp-timeout and takes far longer than usual on a loaded machine.
STARTUP_TIMEOUT_S = 120.0
# Seconds between looks at the ranks' collective records while a test runs.
POLL_S = 0.5

_RANK_COMMAND = "from fsdp_conformance.harness.rank import main; main()"


class RankSetError(RuntimeError):
    """A rank set could not be started (rendezvous, backend or import failure)."""


def describe_exit(returncode: int | None) -> str:
    """'exited with code 3' / 'killed by signal SIGKILL (9)' for a rank's return code."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {name} ({-returncode})"
    return f"exited with code {returncode}"


@dataclasses.dataclass
class RunReport:
    """Everything the controller learnt from one test in a rank set."""

    # one outcome per rank
    outcomes: dict[int, RankOutcome]
    # what each rank printed during the test (stdout and stderr), minus stack dumps
    logs: dict[int, str]
    # what the harness did about state the test left behind, one line each
    notes: list[str] = dataclasses.field(default_factory=list)
    # the last collective each rank entered during the test
    collectives: dict[int, collectives.CollectiveRecord] = dataclasses.field(default_factory=dict)


class RankSet:
    """``world_size`` rank processes sharing one default process group."""

    def __init__(
        self,
        world_size: int,
        backend: str,
        parent_dir: str,
        timeout: float,
        mode: str,
        gpu_ids: tuple[int, ...] = (),
    ) -> None:
        self.world_size = world_size
        self.backend = backend
        self.gpu_ids = gpu_ids
        self.mode = mode
        self.timeout = timeout
        # the FileStore, one output log and one collective slot per rank; removed by kill()
        self.dir = tempfile.mkdtemp(prefix=f"ranks-ws{world_size}-", dir=parent_dir)
        self.log_paths = [os.path.join(self.dir, f"rank{r}.log") for r in range(world_size)]
        self.slot_paths = [os.path.join(self.dir, f"rank{r}.coll") for r in range(world_size)]
        # default process groups created after a test destroyed the previous one
        self.group_generation = 0
        # read position in each log: output before it was already reported
        self.log_offsets = [0] * world_size
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        # output read while taking stack dumps, not yet handed to a RunReport
        self.unreported_output = [""] * world_size
        self.closed = False

    # -------------------------------------------------------------------------
    # Lifecycle

    def start(self) -> None:
        """Spawn the ranks and wait until all joined the process group (else
        :class:`RankSetError`; the set is killed)."""
        try:
            self._spawn()
            self._await_ready(time.monotonic() + max(self.timeout, STARTUP_TIMEOUT_S))
        except BaseException:
            self.kill()
            raise

    def _spawn(self) -> None:
        store = os.path.join(self.dir, "store")
        for rank in range(self.world_size):
            collectives.create_slot_file(self.slot_paths[rank])
            parent_sock, child_sock = socket.socketpair()
            env = dict(os.environ)
            env.update(
                {
                    rank_process.ENV_FD: str(child_sock.fileno()),
                    rank_process.ENV_RANK: str(rank),
                    rank_process.ENV_WORLD_SIZE: str(self.world_size),
                    rank_process.ENV_STORE: store,
                    rank_process.ENV_BACKEND: self.backend,
                    rank_process.ENV_GPU_IDS: ",".join(map(str, self.gpu_ids)),
                    rank_process.ENV_TIMEOUT: str(max(self.timeout, STARTUP_TIMEOUT_S)),
                    rank_process.ENV_MODE: self.mode,
                    rank_process.ENV_COLLECTIVE_SLOT: self.slot_paths[rank],
                    "PYTHONUNBUFFERED": "1",
                }
            )
            # one intra-op thread per rank unless the user chose (torchrun's default too):
            # ranks share the host's cores, and an oversubscribed OpenMP region costs
            # milliseconds per small op (layer_norm on a (6, 2, 16) tensor: 7 ms, not 6 us)
            env.setdefault("OMP_NUM_THREADS", "1")
            with open(self.log_paths[rank], "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-c", _RANK_COMMAND],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=[child_sock.fileno()],
                    env=env,
                    start_new_session=True,  # Ctrl-C goes to pytest, which kills the set
                )
            child_sock.close()
            self.procs.append(proc)
            self.conns.append(Connection(parent_sock.detach()))

    def _await_ready(self, deadline: float) -> None:
        pending = dict(enumerate(self.conns))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                dumps = self._dump_stacks(list(pending))
                raise RankSetError(
                    f"ranks {sorted(pending)} did not join the process group within "
                    f"{max(self.timeout, STARTUP_TIMEOUT_S):g} s (backend {self.backend}).\n"
                    + "\n".join(f"--- rank {r} ---\n{dumps[r]}" for r in sorted(pending))
                )
            for conn in wait(list(pending.values()), timeout=remaining):
                rank = self.conns.index(conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    returncode = self._reap(rank)
                    raise RankSetError(
                        f"rank {rank} {describe_exit(returncode)} while starting:\n"
                        + self._read_log(rank)
                    ) from None
                try:
                    message = expect(message, f"rank {rank}", Ready, StartupFailed)
                except ProtocolError as exc:
                    raise RankSetError(str(exc)) from None
                if isinstance(message, StartupFailed):
                    raise RankSetError(f"rank {rank} failed to start:\n{message.traceback}")
                del pending[rank]

    def close(self) -> None:
        """Ask the ranks to exit, then make sure they are gone; remove the set's files."""
        if self.closed:
            return
        for conn in self.conns:
            try:
                conn.send(Exit())
            except OSError:
                pass
        deadline = time.monotonic() + EXIT_WAIT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """Kill every rank (and anything it started), reap them, remove the set's files."""
        if self.closed:
            return
        self.closed = True
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
                pass
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _reap(self, rank: int) -> int | None:
        try:
            return self.procs[rank].wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def healthy(self) -> bool:
        """Every rank is still running (a rank may die between tests, e.g. killed by OOM)."""
        return not self.closed and all(proc.poll() is None for proc in self.procs)

    # -------------------------------------------------------------------------
    # Running a test

    def run(self, task_blob: bytes, timeout: float) -> RunReport:
        """Run one pickled :class:`RankTask` in every rank and collect the outcomes.

        ``timeout`` starts once every rank imported the test; ranks still running then are
        reported HUNG with their stacks. Ranks that stay ``PEER_GRACE_S`` inside mismatched
        collectives, or in one the finished ranks never entered, are reported then.
        """
        run = _TestRun(self, timeout)
        try:
            for conn in self.conns:
                try:
                    conn.send(RunTest(task_blob))
                except OSError:
                    pass  # noticed below as EOF
            run.collect()
            if run.reusable and self.mode == "process":
                self._restore_group(run)
        except BaseException:
            self.kill()  # KeyboardInterrupt or a harness bug: leave nothing behind
            raise
        logs = {}
        for rank in range(self.world_size):
            logs[rank] = self.unreported_output[rank] + self._read_log(rank)
            self.unreported_output[rank] = ""
        if not run.reusable:
            self.kill()
            if run.notes:
                run.notes.append("the rank set was replaced for the next test")
        return RunReport(
            outcomes=run.outcomes,
            logs=logs,
            notes=run.notes,
            collectives=run.records(),
        )

    def _restore_group(self, run: _TestRun) -> None:
        """Re-create the default group when the test destroyed it in every rank; replace
        the set when only some ranks destroyed it or the re-creation fails."""
        gone = sorted(r for r, alive in run.group_alive.items() if not alive)
        if not gone:
            return
        if len(gone) < self.world_size:
            run.reusable = False
            run.notes.append(
                f"the test destroyed the default process group in rank(s) "
                f"{', '.join(map(str, gone))} only"
            )
            return
        self.group_generation += 1
        for conn in self.conns:
            conn.send(ReinitGroup(self.group_generation))
        deadline = time.monotonic() + max(self.timeout, STARTUP_TIMEOUT_S)
        pending = dict(enumerate(self.conns))
        while pending and time.monotonic() < deadline:
            for conn in wait(list(pending.values()), timeout=deadline - time.monotonic()):
                rank = self.conns.index(conn)
                del pending[rank]
                try:
                    reply = expect(conn.recv(), f"rank {rank}", GroupReinitialized)
                except (EOFError, OSError, ProtocolError) as exc:
                    reply = GroupReinitialized(f"{type(exc).__name__}: {exc}")
                if reply.error:
                    run.reusable = False
                    run.notes.append(
                        f"rank {rank} could not re-create the default process group the test "
                        f"destroyed: {reply.error.strip().splitlines()[-1]}"
                    )
        if pending:
            run.reusable = False
            run.notes.append(
                "re-creating the default process group the test destroyed did not finish in "
                f"rank(s) {', '.join(map(str, sorted(pending)))}"
            )

    # -------------------------------------------------------------------------
    # Output and stack dumps

    def _read_log(self, rank: int) -> str:
        try:
            with open(self.log_paths[rank], "rb") as log:
                log.seek(self.log_offsets[rank])
                data = log.read()
        except OSError:
            return ""
        self.log_offsets[rank] += len(data)
        return data.decode("utf-8", errors="replace")

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Make each rank write all its threads' Python stacks (faulthandler on SIGUSR1)."""
        for rank in ranks:
            # output so far belongs to the rank's log, not to the dump
            self.unreported_output[rank] += self._read_log(rank)
            if self.procs[rank].poll() is None:
                try:
                    os.kill(self.procs[rank].pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + DUMP_WAIT_S
        sizes = {rank: -1 for rank in ranks}
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = {rank: os.path.getsize(self.log_paths[rank]) for rank in ranks}
            written = all(now[r] > self.log_offsets[r] for r in ranks)
            if written and now == sizes:
                break
            sizes = now
        dumps = {}
        for rank in ranks:
            text = _drop_watchdog_thread(self._read_log(rank))
            if not text.strip():
                text = f"(no stack dump: the rank {describe_exit(self.procs[rank].poll())})"
            dumps[rank] = text
        return dumps


class _TestRun:
    """The controller's bookkeeping while one test runs in a rank set."""

    def __init__(self, rank_set: RankSet, timeout: float) -> None:
        self.rank_set = rank_set
        self.timeout = timeout
        self.outcomes: dict[int, RankOutcome] = {}
        self.reusable = True
        self.notes: list[str] = []
        # rank -> whether its default process group survived the test
        self.group_alive: dict[int, bool] = {}
        self.started: set[int] = set()
        # the first rank that failed / died / skipped; the others then get PEER_GRACE_S
        self.first_trouble: RankOutcome | None = None
        self.trouble_since: float | None = None
        # when ranks were first seen stuck in mismatched or unmatched collectives
        self.mismatch_since: float | None = None
        # the collective records of the last look, while ranks seemed stuck
        self.stuck_records: dict[int, collectives.CollectiveRecord] | None = None

    def records(self) -> dict[int, collectives.CollectiveRecord]:
        found = {}
        for rank, path in enumerate(self.rank_set.slot_paths):
            record = collectives.read_slot_file(path)
            if record is not None:
                found[rank] = record
        return found

    def _passed(self) -> set[int]:
        return {rank for rank, outcome in self.outcomes.items() if outcome.status == PASSED}

    def _trouble(self, outcome: RankOutcome) -> None:
        if self.first_trouble is None:
            self.first_trouble = outcome
            self.trouble_since = time.monotonic()

    def collect(self) -> None:
        """Wait for every rank's outcome (or decide it hung), then tell causes from
        consequences."""
        self._wait_for_outcomes()
        self._mark_consequences()

    def _mark_consequences(self) -> None:
        """A rank whose collective raised because another rank died, failed outside a
        collective or skipped (gloo: "Connection closed by peer") is a consequence: reported
        ABORTED, naming the cause, never as a failure of its own."""
        records = self.records()

        def in_collective(outcome: RankOutcome) -> bool:
            record = records.get(outcome.rank)
            return outcome.status == FAILED and record is not None and record.raised

        causes = [
            o
            for o in sorted(self.outcomes.values(), key=lambda o: o.rank)
            if o.status in (DIED, SKIPPED) or (o.status == FAILED and not in_collective(o))
        ]
        for rank, outcome in list(self.outcomes.items()):
            others = [c for c in causes if c.rank != rank]
            if in_collective(outcome) and others:
                cause = others[0]
                self.outcomes[rank] = dataclasses.replace(
                    outcome,
                    status=ABORTED,
                    message=f"failed in {records[rank].where()} after rank {cause.rank} "
                    f"{cause.status}: {outcome.message}",
                )

    def _wait_for_outcomes(self) -> None:
        rank_set = self.rank_set
        timeout = self.timeout
        load_deadline = time.monotonic() + max(timeout, STARTUP_TIMEOUT_S)
        # set when every rank has started the body (or already finished)
        body_deadline: float | None = None
        pending = dict(enumerate(rank_set.conns))
        while pending:
            now = time.monotonic()
            deadline = load_deadline if body_deadline is None else body_deadline
            limit = deadline
            if self.trouble_since is not None:
                limit = min(limit, self.trouble_since + PEER_GRACE_S)
            if self.mismatch_since is not None:
                limit = min(limit, self.mismatch_since + PEER_GRACE_S)
            if now >= limit:
                self._hung(list(pending), now, deadline, body_deadline is None)
                return
            ready = wait(list(pending.values()), timeout=min(limit - now, POLL_S))
            for conn in ready:
                rank = rank_set.conns.index(conn)
                self._receive(rank, conn, pending)
            if body_deadline is None and self.started | set(self.outcomes) == set(
                range(rank_set.world_size)
            ):
                body_deadline = time.monotonic() + timeout
            if body_deadline is not None and pending:
                self._look_for_mismatch(pending)

    def _receive(self, rank: int, conn: Connection, pending: dict[int, Connection]) -> None:
        try:
            message = expect(conn.recv(), f"rank {rank}", Started, Finished)
        except (EOFError, OSError):
            del pending[rank]
            returncode = self.rank_set._reap(rank)
            self.outcomes[rank] = RankOutcome(
                rank, DIED, message=f"rank {rank} {describe_exit(returncode)}"
            )
            self.reusable = False
            self._trouble(self.outcomes[rank])
            return
        except ProtocolError as exc:
            del pending[rank]
            self.outcomes[rank] = RankOutcome(rank, FAILED, message=f"ProtocolError: {exc}")
            self.reusable = False
            self._trouble(self.outcomes[rank])
            return
        if isinstance(message, Started):
            self.started.add(rank)
            return
        del pending[rank]
        outcome = message.outcome
        self.outcomes[rank] = outcome
        self.group_alive[rank] = message.group_alive
        self.notes.extend(message.notes)
        self.reusable = self.reusable and message.reusable
        if outcome.status not in (PASSED, SKIPPED):
            self.reusable = False
        if outcome.status != PASSED:
            self._trouble(outcome)

    def _look_for_mismatch(self, pending: dict[int, Connection]) -> None:
        records = self.records()
        inside = all(rank in records and records[rank].inside for rank in pending)
        finished = self._passed()
        stuck = inside and (
            collectives.mismatch(records)
            or all(collectives.unmatched(records, finished, rank) for rank in pending)
        )
        if stuck and records == self.stuck_records:
            self.mismatch_since = self.mismatch_since or time.monotonic()
        else:
            self.mismatch_since = None
        self.stuck_records = records if stuck else None

    def _hung(self, ranks: list[int], now: float, deadline: float, loading: bool) -> None:
        dumps = self.rank_set._dump_stacks(ranks)
        records = self.records()
        for rank in ranks:
            where = records[rank].describe() if rank in records else ""
            unmatched = collectives.unmatched(records, self._passed(), rank)
            if self.mismatch_since is not None and now < deadline:
                why = f"waiting {where}; " + (
                    collectives.mismatch(records) or f"never entered by the others: {unmatched}"
                )
            elif now < deadline and self.first_trouble is not None:
                first = self.first_trouble
                why = (
                    f"was still running {PEER_GRACE_S:g} s after rank {first.rank} "
                    f"{first.status}" + (f" (waiting {where})" if where.startswith("in ") else "")
                )
            elif loading:
                why = (
                    "did not finish importing the test within "
                    f"{max(self.timeout, STARTUP_TIMEOUT_S):g} s"
                )
            else:
                why = f"did not finish within the timeout of {self.timeout:g} s"
                outside = [r for r in ranks if r not in records or not records[r].inside]
                if where.startswith("in ") and outside:
                    why = (
                        f"waiting {where} for rank(s) {', '.join(map(str, outside))}, which "
                        f"did not finish within the timeout of {self.timeout:g} s"
                    )
            self.outcomes[rank] = RankOutcome(rank, HUNG, message=why, traceback=dumps[rank])
        self.reusable = False


def _drop_watchdog_thread(dump: str) -> str:
    """Remove the rank's parent-watchdog thread from a faulthandler dump (noise)."""
    blocks = dump.split("\n\n")
    kept = [b for b in blocks if "in _watch_parent" not in b]
    return "\n\n".join(kept)
