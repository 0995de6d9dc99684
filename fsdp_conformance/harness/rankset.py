"""The rank set: ``world_size`` rank processes in one default process group (FileStore in the
set's private directory), seen from the controller: spawn, run a test (outcomes, output, hang
and mismatch reports), tear down. ``process`` mode reuses a set, ``process-fresh`` does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from fsdp_conformance.harness import collectives, gpus, wire, zygote
from fsdp_conformance.harness import rank as rank_process
from fsdp_conformance.harness.wire import ABORTED, DIED, FAILED, HUNG, PASSED, SKIPPED, RankOutcome

# Seconds the other ranks get after one rank failed, died or skipped before they are reported
# stuck (typically in a collective with that rank) and killed.
PEER_GRACE_S = 3.0
# Seconds to wait for a rank's faulthandler dump to be written after SIGUSR1.
DUMP_WAIT_S = 3.0
# Seconds a rank gets to exit on request before it is killed.
EXIT_WAIT_S = 2.0
# Least seconds a rank set gets to start (import torch, rendezvous; slow on a loaded machine).
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
        # the FileStore, one output log and one collective slot per rank
        self.dir = tempfile.mkdtemp(prefix=f"ranks-ws{world_size}-", dir=parent_dir)
        self.log_paths = [os.path.join(self.dir, f"rank{r}.log") for r in range(world_size)]
        self.slot_paths = [os.path.join(self.dir, f"rank{r}.coll") for r in range(world_size)]
        # default process groups created after a test destroyed the previous one
        self.group_generation = 0
        # read position in each log
        self.log_offsets = [0] * world_size
        self.procs: list[Any] = []  # subprocess.Popen or zygote.ForkedProcess
        self.conns: list[Connection] = []
        # output read while taking stack dumps, not yet reported
        self.unreported_output = [""] * world_size
        self.closed = False

    def start(self) -> None:
        """Spawn the ranks and wait until all joined the group (else :class:`RankSetError`)."""
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
            env = {
                **os.environ,
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
            # one intra-op thread per rank unless the user chose (torchrun's default too):
            # ranks share the host's cores, and an oversubscribed OpenMP region costs
            # milliseconds per small op (layer_norm on a (6, 2, 16) tensor: 7 ms, not 6 us)
            env.setdefault("OMP_NUM_THREADS", "1")
            if not self.gpu_ids or gpus.fake_gpu_count() is not None:
                # ranks that run on CPU see no GPU, as on a CPU-only host: an implementation
                # that defaults to the current CUDA device would otherwise compute there
                env["CUDA_VISIBLE_DEVICES"] = ""
            proc: Any = None
            if zygote.available():
                with contextlib.suppress(OSError):  # else a fresh interpreter, as without one
                    proc = zygote.spawn(env, self.log_paths[rank], child_sock.fileno())
            if proc is None:
                with open(self.log_paths[rank], "wb") as log:  # Ctrl-C: pytest kills the set
                    proc = zygote.start_python(_RANK_COMMAND, log, child_sock.fileno(), env)
            child_sock.close()
            self.procs.append(proc)
            self.conns.append(Connection(parent_sock.detach()))

    def _await_ready(self, deadline: float) -> None:
        pending = dict(enumerate(self.conns))
        while pending:
            if (remaining := deadline - time.monotonic()) <= 0:
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
                    raise RankSetError(
                        f"rank {rank} {describe_exit(self._reap(rank))} while starting:\n"
                        + self._read_log(rank)
                    ) from None
                try:
                    message = wire.expect(message, f"rank {rank}", wire.Ready, wire.StartupFailed)
                except wire.ProtocolError as exc:
                    raise RankSetError(str(exc)) from None
                if isinstance(message, wire.StartupFailed):
                    raise RankSetError(f"rank {rank} failed to start:\n{message.traceback}")
                del pending[rank]

    def close(self) -> None:
        """Ask the ranks to exit, then :meth:`kill` what is left."""
        if self.closed:
            return
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(wire.Exit())
        deadline = time.monotonic() + EXIT_WAIT_S
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every rank (and anything it started), reap them, remove the set's files."""
        if self.closed:
            return
        self.closed = True
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable (D state)
                proc.wait(timeout=10)
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

    def run(self, task_blob: bytes, timeout: float) -> wire.RunResult:
        """Run one pickled ``RankTask`` in every rank and combine the outcomes; ``timeout``
        starts once every rank imported the test."""
        run = _TestRun(self, timeout)
        try:
            for conn in self.conns:
                with contextlib.suppress(OSError):  # noticed below as EOF
                    conn.send(wire.RunTest(task_blob))
            run.collect()
            if run.reusable and self.mode == "process":
                self._restore_group(run)
        except BaseException:
            self.kill()  # KeyboardInterrupt or a harness bug: leave nothing behind
            raise
        logs = {r: self.unreported_output[r] + self._read_log(r) for r in range(self.world_size)}
        self.unreported_output = [""] * self.world_size
        if not run.reusable:
            self.kill()
            if run.notes:
                run.notes.append("the rank set was replaced for the next test")
        verdict = wire.summarize(run.outcomes, self.world_size, collectives.mismatch(run.records()))
        return wire.RunResult(verdict, logs, run.notes)

    def _restore_group(self, run: _TestRun) -> None:
        """Re-create the default group when the test destroyed it in every rank; replace
        the set when only some ranks destroyed it or the re-creation fails."""
        if not (gone := sorted(r for r, alive in run.group_alive.items() if not alive)):
            return
        if len(gone) < self.world_size:
            ranks = ", ".join(map(str, gone))
            run.replace(f"the test destroyed the default process group in rank(s) {ranks} only")
            return
        self.group_generation += 1
        for conn in self.conns:
            conn.send(wire.ReinitGroup(self.group_generation))
        deadline = time.monotonic() + max(self.timeout, STARTUP_TIMEOUT_S)
        pending = dict(enumerate(self.conns))
        while pending and time.monotonic() < deadline:
            for conn in wait(list(pending.values()), timeout=deadline - time.monotonic()):
                rank = self.conns.index(conn)
                del pending[rank]
                try:
                    reply = wire.expect(conn.recv(), f"rank {rank}", wire.GroupReinitialized)
                except (EOFError, OSError, wire.ProtocolError) as exc:
                    reply = wire.GroupReinitialized(f"{type(exc).__name__}: {exc}")
                if reply.error:
                    run.replace(
                        f"rank {rank} could not re-create the default process group the test "
                        f"destroyed: {reply.error.strip().splitlines()[-1]}"
                    )
        if pending:
            run.replace(
                "re-creating the default process group the test destroyed did not finish in "
                f"rank(s) {', '.join(map(str, sorted(pending)))}"
            )

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
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.procs[rank].pid, signal.SIGUSR1)
        deadline = time.monotonic() + DUMP_WAIT_S
        sizes = {rank: -1 for rank in ranks}
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = {rank: os.path.getsize(self.log_paths[rank]) for rank in ranks}
            if all(now[r] > self.log_offsets[r] for r in ranks) and now == sizes:
                break
            sizes = now
        dumps = {}
        for rank in ranks:
            # without the rank's parent-watchdog thread (noise)
            blocks = self._read_log(rank).split("\n\n")
            text = "\n\n".join(block for block in blocks if "in _watch_parent" not in block)
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
        # since when, and with which records, ranks seem stuck in mismatched collectives
        self.mismatch_since: float | None = None
        self.stuck_records: dict[int, collectives.CollectiveRecord] | None = None

    def replace(self, note: str) -> None:
        """The rank set is replaced after this test, saying why."""
        self.reusable = False
        self.notes.append(note)

    def records(self) -> dict[int, collectives.CollectiveRecord]:
        found = {r: collectives.read_slot_file(p) for r, p in enumerate(self.rank_set.slot_paths)}
        return {rank: record for rank, record in found.items() if record is not None}

    def _passed(self) -> set[int]:
        return {rank for rank, outcome in self.outcomes.items() if outcome.status == PASSED}

    def _trouble(self, outcome: RankOutcome) -> None:
        if self.first_trouble is None:
            self.first_trouble = outcome
            self.trouble_since = time.monotonic()

    def _mark_consequences(self) -> None:
        """A rank whose collective raised after another rank died, failed outside a collective
        or skipped (gloo: "Connection closed by peer") is reported ABORTED, naming the cause."""
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

    def collect(self) -> None:
        """Wait for every rank's outcome (or decide it hung), then tell causes from
        consequences."""
        conns, everyone = self.rank_set.conns, set(range(self.rank_set.world_size))
        load_deadline = time.monotonic() + max(self.timeout, STARTUP_TIMEOUT_S)
        # set when every rank has started the body (or already finished)
        body_deadline: float | None = None
        pending = dict(enumerate(conns))
        while pending:
            now = time.monotonic()
            deadline = load_deadline if body_deadline is None else body_deadline
            since = (self.trouble_since, self.mismatch_since)
            limit = min([deadline, *(t + PEER_GRACE_S for t in since if t is not None)])
            if now >= limit:
                self._hung(list(pending), now, deadline, body_deadline is None)
                break
            for conn in wait(list(pending.values()), timeout=min(limit - now, POLL_S)):
                self._receive(conns.index(conn), conn, pending)
            if body_deadline is None and self.started | set(self.outcomes) == everyone:
                body_deadline = time.monotonic() + self.timeout
            if body_deadline is not None and pending:
                self._look_for_mismatch(pending)
        self._mark_consequences()

    def _receive(self, rank: int, conn: Connection, pending: dict[int, Connection]) -> None:
        try:
            message = wire.expect(conn.recv(), f"rank {rank}", wire.Started, wire.Finished)
        except (EOFError, OSError, wire.ProtocolError) as exc:
            del pending[rank]
            if isinstance(exc, wire.ProtocolError):
                outcome = RankOutcome(rank, FAILED, message=f"ProtocolError: {exc}")
            else:
                died = describe_exit(self.rank_set._reap(rank))
                outcome = RankOutcome(rank, DIED, message=f"rank {rank} {died}")
            self.outcomes[rank] = outcome
            self.reusable = False
            self._trouble(outcome)
            return
        if isinstance(message, wire.Started):
            self.started.add(rank)
            return
        del pending[rank]
        outcome = message.outcome
        self.outcomes[rank] = outcome
        self.group_alive[rank] = message.group_alive
        self.notes.extend(message.notes)
        self.reusable &= message.reusable and outcome.status in (PASSED, SKIPPED)
        if outcome.status != PASSED:
            self._trouble(outcome)

    def _look_for_mismatch(self, pending: dict[int, Connection]) -> None:
        records = self.records()
        inside = all(rank in records and records[rank].inside for rank in pending)
        stuck = inside and (
            collectives.mismatch(records)
            or all(collectives.unmatched(records, self._passed(), rank) for rank in pending)
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
                startup = max(self.timeout, STARTUP_TIMEOUT_S)
                why = f"did not finish importing the test within {startup:g} s"
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
