"""The messages between the controller (pytest) and its rank processes, and the verdict
combined from the ranks' outcomes; torch-free. A side that receives a message of a type it
does not expect raises :class:`ProtocolError` (:func:`expect`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

# Every rank seeds torch, random and numpy with this before each test.
RANK_SEED = 0

# Outcome statuses of one rank.
PASSED = "passed"
FAILED = "failed"
SKIPPED = "skipped"
XFAILED = "xfailed"
# Decided by the controller, never sent by a rank:
DIED = "died"  # the rank process exited or was killed while running the test
HUNG = "hung"  # the rank did not finish within the timeout (or the grace after another failed)
ABORTED = "aborted"  # the rank stopped because another rank failed


@dataclasses.dataclass(frozen=True)
class TestTarget:
    """Where a test callable lives, so that a rank process can import it by file path."""

    module_name: str
    # loaded with pytest's assertion rewriting
    module_file: str | None
    # attributes leading from the module to the (nested) test class; () for functions
    class_path: tuple[str, ...]
    function_name: str
    # "pytest": fixture values + ``dist``; "unittest": TestCase ``debug()``
    kind: str = "pytest"


@dataclasses.dataclass
class RankTask:
    """One test as every rank runs it, in every mode (pickled to rank processes)."""

    target: TestTarget
    test_id: str
    # shared by all ranks, removed by the controller after the test
    tmp_path: str
    impl: str
    # seconds; also the deadline of collectives the rank starts
    timeout: float
    # whether the test function takes `dist` itself (else only through a fixture)
    wants_dist: bool = True
    # module-level functions to call after the test (rank.add_after_test)
    after_test: tuple[Callable[[], None], ...] = ()
    # rank processes only: the pickled fixture values (unpickled after the test module is
    # imported, so classes defined there work), and the controller's sys.path, cwd, environment
    kwargs_blob: bytes = b""
    sys_path: list[str] = dataclasses.field(default_factory=list)
    cwd: str = ""
    environ: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RankOutcome:
    """What one rank reports for one test."""

    rank: int
    status: str
    # one line: exception "Type: message", skip reason, how the rank died
    message: str = ""
    # formatted traceback or stack dump
    traceback: str = ""
    duration: float = 0.0
    # (name, value) report properties the body recorded (harness/properties.py)
    properties: list[tuple[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class InRank:
    """A fixture value built inside every rank instead of being pickled.

    Return ``InRank(factory, *args, **kwargs)`` from a fixture whose value cannot be pickled
    (an FSDP adapter, a model): each rank calls ``factory(*args, **kwargs)`` before the body.
    ``factory`` must be importable (module level); if it accepts a keyword argument ``dist``
    it receives the rank's context. ``args`` and ``kwargs`` must be picklable.
    """

    factory: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __init__(self, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.factory = factory
        self.args = args
        self.kwargs = kwargs


@dataclasses.dataclass(frozen=True)
class RankMonkeyPatch:
    """A ``monkeypatch`` fixture sent to rank processes: a fresh one in each rank."""


class ProtocolError(RuntimeError):
    """A message of a type the receiving side does not expect at this point."""


# Controller -> rank.
@dataclasses.dataclass(frozen=True)
class RunTest:
    """Run one test (a pickled :class:`RankTask`)."""

    task_blob: bytes


@dataclasses.dataclass(frozen=True)
class ReinitGroup:
    """The test destroyed every rank's default group: make a new one (keys prefixed with
    ``generation``)."""

    generation: int


@dataclasses.dataclass(frozen=True)
class Exit:
    """Leave now."""


# Rank -> controller: Ready or StartupFailed once; per test Started, then Finished.
@dataclasses.dataclass(frozen=True)
class Ready:
    pid: int


@dataclasses.dataclass(frozen=True)
class StartupFailed:
    traceback: str


@dataclasses.dataclass(frozen=True)
class Started:
    """The test is imported and its fixture values unpickled: its timeout starts when every
    rank sent this."""


@dataclasses.dataclass(frozen=True)
class Finished:
    """The test's outcome, after the rank restored its per-test state."""

    outcome: RankOutcome
    # False: the rank could not restore its state (it leaves after sending this)
    reusable: bool
    # whether the default process group still exists
    group_alive: bool = True
    # what the rank could not undo, one line each
    notes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class GroupReinitialized:
    """The answer to :class:`ReinitGroup`; ``error`` is "" on success."""

    error: str = ""


def expect(message: object, sender: str, *types: type) -> Any:
    """``message`` if it is one of ``types``, else :class:`ProtocolError` saying so."""
    if isinstance(message, types):
        return message
    raise ProtocolError(
        f"unexpected message from {sender}: {message!r} (expected "
        f"{' or '.join(t.__name__ for t in types)}); the rank and the controller run different "
        "versions of fsdp_conformance, or test code wrote to the rank's connection"
    )


@dataclasses.dataclass
class Verdict:
    """The test's result as pytest / unittest should report it: PASSED, FAILED, SKIPPED or
    XFAILED, the failure report or reason, the properties of the lowest rank that recorded any."""

    status: str
    message: str = ""
    properties: list[tuple[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RunResult:
    """A verdict, what the ranks printed (rank -> text), and what the harness did about state
    the test left behind."""

    verdict: Verdict
    logs: dict[int, str] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    def output(self) -> str:
        """The ranks' output, one section per rank that printed something."""
        return "".join(
            f"----- rank {rank} output -----\n{text}{'' if text.endswith(chr(10)) else chr(10)}"
            for rank, text in sorted(self.logs.items())
            if text
        )


def not_run(status: str, message: str) -> RunResult:
    """The result of a test decided without running it in ranks."""
    return RunResult(Verdict(status, message))


# Order in which problems are reported: the cause first, its consequences after.
_SEVERITY = {DIED: 0, FAILED: 1, HUNG: 2, ABORTED: 3}


def summarize(outcomes: dict[int, RankOutcome], world_size: int, mismatch: str = "") -> Verdict:
    """Combine per-rank outcomes: any failure fails, then xfail, then skip, else pass.

    A failure names every rank's outcome and shows each distinct traceback once; ``mismatch``
    (ranks in different collectives entered as the same one) leads the report.
    """
    for rank_id in range(world_size):  # a rank that reported nothing is a harness bug
        outcomes.setdefault(rank_id, RankOutcome(rank_id, HUNG, message="reported no result"))
    ordered = sorted(outcomes.values(), key=lambda o: o.rank)
    recorded = next((o.properties for o in ordered if o.properties), [])
    problems = sorted(
        (o for o in ordered if o.status in _SEVERITY), key=lambda o: _SEVERITY[o.status]
    )
    if not problems:
        for status in (XFAILED, SKIPPED):
            if (first := next((o for o in ordered if o.status == status), None)) is not None:
                return Verdict(status, first.message, list(recorded))
        return Verdict(PASSED, "", list(recorded))
    lines = [mismatch] if mismatch else []
    for o in [*problems, *(o for o in ordered if o.status in (SKIPPED, XFAILED))]:
        what = o.message.removeprefix(f"rank {o.rank} ") if o.status == DIED else o.message
        lines.append(f"rank {o.rank} of {world_size} {o.status}: {what}")
    if passed := [str(o.rank) for o in ordered if o.status == PASSED]:
        lines.append(f"ranks that passed: {', '.join(passed)}")
    shown: dict[str, int] = {}  # traceback text -> first rank that showed it
    for o in problems:
        if (details := o.traceback.rstrip()) in shown:
            lines.append(f"\n===== rank {o.rank}: same traceback as rank {shown[details]} =====")
        elif details:
            shown[details] = o.rank
            title = "stack dump" if o.status == HUNG else "traceback"
            lines.append(f"\n===== rank {o.rank} {title} =====\n{details}")
    return Verdict(FAILED, "\n".join(lines), list(recorded))
