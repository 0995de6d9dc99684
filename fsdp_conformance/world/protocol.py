"""Messages between the parent (pytest) and its ranks.

Torch-free: the parent of ``process`` / ``process-fresh`` ranks never needs torch.
Everything here is pickled over the parent <-> rank connection. Each message is a small
frozen dataclass; a side that receives anything else raises :class:`ProtocolError` (see
:func:`expect`) instead of guessing.

Parent -> rank: :class:`RunTest`, :class:`ReinitGroup`, :class:`Exit`.
Rank -> parent: :class:`Ready` or :class:`StartupFailed` once; per test :class:`Started` then
:class:`Finished`; :class:`GroupReinitialized` after a :class:`ReinitGroup`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

# Seed every rank's RNGs (torch, random, numpy) with before each test; tests that want
# rank-dependent data seed themselves.
RANK_SEED = 0

# Outcome statuses of one rank.
PASSED = "passed"
FAILED = "failed"
SKIPPED = "skipped"
XFAILED = "xfailed"
# Set by the parent, never sent by a rank:
DIED = "died"  # the rank process exited or was killed while running the test
HUNG = "hung"  # the rank did not finish within the timeout (or the grace after another rank failed)
ABORTED = "aborted"  # thread mode: the rank stopped because another rank failed


@dataclasses.dataclass(frozen=True)
class TestTarget:
    """Where a test callable lives, so that a rank process can import it by file path."""

    # the name the test module is imported under (pytest's module name; may be dotted)
    module_name: str
    # the test module's file (absolute); the rank loads it from here with assertion rewriting
    module_file: str | None
    # attribute names leading from the module to the test class (nested classes); () for functions
    class_path: tuple[str, ...]
    # attribute name of the test function / method
    function_name: str
    # "pytest": call the function with fixture kwargs + ``dist``;
    # "unittest": instantiate the TestCase with function_name and run ``debug()``
    kind: str = "pytest"


@dataclasses.dataclass
class RankTask:
    """One test, sent to every rank of a rank set."""

    target: TestTarget
    # pickle of the fixture values other than ``dist`` (unpickled in the rank after the
    # test module was imported, so values whose classes live in the test module work)
    kwargs_blob: bytes
    test_id: str
    seed: int
    # per-test directory shared by all ranks (removed by the parent after the test)
    tmp_path: str
    # parent's sys.path / cwd / environment at the time of the test
    sys_path: list[str]
    cwd: str
    environ: dict[str, str]
    # --fsdp-impl: the implementation name adapters resolve in the rank
    impl: str
    # deadline for collectives the rank starts (seconds)
    timeout: float
    # whether the test function takes `dist` (it may get it only through a fixture)
    wants_dist: bool = True
    # module-level functions to call after the test (world/hooks.py), registered on receipt
    after_test: tuple[Callable[[], None], ...] = ()


@dataclasses.dataclass
class RankOutcome:
    """What one rank reports for one test."""

    rank: int
    status: str
    # one-line message (exception "Type: message", skip reason, how the rank died)
    message: str = ""
    # full formatted traceback / stack dump; "" when not applicable
    traceback: str = ""
    # seconds the test body ran in this rank
    duration: float = 0.0
    # (name, value) report properties the body recorded (world/properties.py)
    properties: list[tuple[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class InRank:
    """A fixture value that is built inside every rank instead of being pickled.

    Return ``InRank(factory, *args, **kwargs)`` from a fixture whose value cannot be
    pickled (an FSDP adapter, a model): each rank calls ``factory(*args, **kwargs)`` before
    the test body and passes the result. ``factory`` must be importable (module-level);
    if it accepts a keyword argument ``dist`` it receives the rank's context.

    Args:
        factory: module-level callable building the value.
        args: positional arguments (picklable).
        kwargs: keyword arguments (picklable).
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
    """Stands for a ``monkeypatch`` fixture sent to rank processes: each rank gets a fresh
    ``pytest.MonkeyPatch``, undone after the test (the parent's one stays in the parent)."""


# -----------------------------------------------------------------------------
# Typed messages


class ProtocolError(RuntimeError):
    """A message of a type the receiving side does not expect at this point."""


@dataclasses.dataclass(frozen=True)
class RunTest:
    """Parent -> rank: run one test (a pickled :class:`RankTask`)."""

    task_blob: bytes


@dataclasses.dataclass(frozen=True)
class ReinitGroup:
    """Parent -> rank: every rank's default process group was destroyed by the test;
    initialise a new one (rendezvous keys prefixed with ``generation``)."""

    generation: int


@dataclasses.dataclass(frozen=True)
class Exit:
    """Parent -> rank: leave now."""


@dataclasses.dataclass(frozen=True)
class Ready:
    """Rank -> parent: joined the default process group; waiting for tests."""

    pid: int


@dataclasses.dataclass(frozen=True)
class StartupFailed:
    """Rank -> parent: start-up (import, rendezvous) failed with this traceback."""

    traceback: str


@dataclasses.dataclass(frozen=True)
class Started:
    """Rank -> parent: the test module is imported and the fixture values unpickled; the
    test's timeout starts when every rank sent this."""


@dataclasses.dataclass(frozen=True)
class Finished:
    """Rank -> parent: the test's outcome, after the rank restored its per-test state."""

    outcome: RankOutcome
    # False: the rank could not restore its state (it leaves after sending this)
    reusable: bool
    # whether the default process group still exists (a test may destroy it)
    group_alive: bool = True
    # what the rank could not undo, one line each (said once in the test's report)
    notes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class GroupReinitialized:
    """Rank -> parent: answer to :class:`ReinitGroup`; ``error`` is "" on success."""

    error: str = ""


def expect(message: object, sender: str, *types: type) -> Any:
    """Return ``message`` if it is an instance of one of ``types``.

    Raises:
        ProtocolError: naming the sender, what arrived and what was expected.
    """
    if isinstance(message, types):
        return message
    raise ProtocolError(
        f"unexpected message from {sender}: {message!r} (expected "
        f"{' or '.join(t.__name__ for t in types)}); the rank and the parent run different "
        "versions of fsdp_conformance, or test code wrote to the rank's connection"
    )
