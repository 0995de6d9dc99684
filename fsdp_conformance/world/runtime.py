"""The parent side of the rank runtime: choose mode, backend and GPUs, keep the reusable
rank sets, run one test, and turn the ranks' outcomes into a verdict.

One :class:`Runtime` per pytest process (the plugin keeps it in ``config.stash``; each
pytest-xdist worker has its own). :func:`get_runtime` gives FSDPTest the active one, or a
default one outside pytest.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from fsdp_conformance import vocab
from fsdp_conformance.world import collectives, gpus, hooks, report
from fsdp_conformance.world.procs import RankSet, RankSetError
from fsdp_conformance.world.protocol import (
    FAILED,
    RANK_SEED,
    SKIPPED,
    RankMonkeyPatch,
    RankTask,
    TestTarget,
)

MODES = vocab.MODES
ENV_BACKEND = vocab.ENV_BACKEND
ENV_MODE = vocab.ENV_MODE
ENV_TIMEOUT = vocab.ENV_TIMEOUT
# At most this many pooled rank processes stay alive (least recently used sets go first).
MAX_POOLED_RANKS = 8
# Backends --fsdp-backend / FSDP_CONFORMANCE_BACKEND accept.
BACKENDS = ("gloo", "nccl", "ucc", "mpi", "xccl")
DEFAULT_TIMEOUT_S = vocab.DEFAULT_TIMEOUT_S


class OptionError(ValueError):
    """An option or environment variable of the runtime has a value it cannot use."""


def parse_timeout(value: object, source: str) -> float:
    """``value`` as a timeout in seconds (a finite number > 0).

    Args:
        value: the text or number given.
        source: where it came from, for the message ("--fsdp-timeout", "FSDP_CONFORMANCE_TIMEOUT").

    Raises:
        OptionError: naming ``source``, the value and what is accepted.
    """
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise OptionError(
            f"{source}={value!r}: the timeout must be a number of seconds > 0 (e.g. 120)"
        )
    return seconds


def parse_mode(value: str, source: str) -> str:
    """``value`` if it names a mode, else :class:`OptionError` naming ``source``."""
    if value not in MODES:
        raise OptionError(f"{source}={value!r}: use one of {', '.join(MODES)}")
    return value


def parse_backend(value: str | None, source: str) -> str | None:
    """``value`` if it names a backend (None / "": choose automatically), else
    :class:`OptionError` naming ``source``."""
    if not value:
        return None
    if value not in BACKENDS:
        raise OptionError(
            f"{source}={value!r}: use one of {', '.join(BACKENDS)} (or leave it unset: gloo "
            "on CPU, nccl when each rank gets its own GPU)"
        )
    return value


def parse_world_size(value: object, source: str) -> int:
    """``value`` as a world size >= 1, else :class:`OptionError` naming ``source``."""
    try:
        size = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        size = 0
    if size < 1 or str(size) != str(value).strip():
        raise OptionError(f"{source}={value!r}: the world size must be a whole number >= 1")
    return size


class FixtureNotPicklable(TypeError):
    """A fixture value cannot be sent to rank processes."""


@dataclasses.dataclass
class RuntimeOptions:
    """Session-wide settings (pytest options, or environment variables outside pytest)."""

    # default mode: "process", "process-fresh" or "thread"
    mode: str = vocab.DEFAULT_MODE
    # seconds a test may run in its ranks before it is failed with stack dumps
    timeout: float = DEFAULT_TIMEOUT_S
    # world size for tests that do not say
    world_size: int = 2
    # --fsdp-impl: FSDP implementation under test, passed to the ranks as dist.impl
    impl: str = "impl"
    # backend override ("gloo", "nccl"); None: gloo on CPU, nccl when each rank gets a GPU
    backend: str | None = None
    # module-level functions every rank calls after each test, before the test's non-default
    # process groups are destroyed (world/hooks.py; the plugin passes the adapters' on_test_end)
    after_test: tuple[Callable[[], None], ...] = ()

    @classmethod
    def from_env(cls) -> RuntimeOptions:
        """Options from ``FSDP_CONFORMANCE_MODE`` / ``_TIMEOUT`` / ``_BACKEND``.

        Raises:
            OptionError: a variable has a value the runtime cannot use (named in the message).
        """
        return cls(
            mode=parse_mode(os.environ.get(ENV_MODE) or vocab.DEFAULT_MODE, ENV_MODE),
            timeout=parse_timeout(os.environ.get(ENV_TIMEOUT) or DEFAULT_TIMEOUT_S, ENV_TIMEOUT),
            backend=parse_backend(os.environ.get(ENV_BACKEND), ENV_BACKEND),
        )


@dataclasses.dataclass
class TestRequest:
    """One test to run in ranks."""

    # where rank processes find the test callable
    target: TestTarget
    # fixture values other than `dist` (pickled for rank processes)
    kwargs: dict[str, Any]
    # pytest node id (or unittest id)
    test_id: str
    world_size: int
    mode: str
    timeout: float
    # GPUs the test needs (0: none required; it may still get nccl + GPUs when available)
    gpus: int = 0
    # thread mode: called in each rank thread with the rank's context
    thread_body: Callable[[Any], None] | None = None
    # whether the test function takes `dist` itself (else only through a fixture)
    wants_dist: bool = True


@dataclasses.dataclass
class RunResult:
    """A verdict plus what the ranks printed."""

    verdict: report.Verdict
    # rank -> output printed during the test (process modes; thread output is not captured)
    logs: dict[int, str]
    # what the harness did about state the test left behind (for the test's report section)
    notes: list[str] = dataclasses.field(default_factory=list)

    def output(self) -> str:
        """The ranks' output, one section per rank that printed something."""
        return "".join(
            f"----- rank {rank} output -----\n{text}{'' if text.endswith(chr(10)) else chr(10)}"
            for rank, text in sorted(self.logs.items())
            if text
        )


def pickle_kwargs(kwargs: dict[str, Any]) -> bytes:
    """Pickle fixture values for rank processes, naming the fixture that cannot be sent."""
    try:
        return pickle.dumps(kwargs)
    except Exception:  # noqa: BLE001, S110  find out which value it was, below
        pass
    for name, value in kwargs.items():
        try:
            pickle.dumps(value)
        except Exception as exc:  # noqa: BLE001
            raise FixtureNotPicklable(
                f"fixture {name!r} (a {type(value).__module__}.{type(value).__qualname__}) "
                f"cannot be sent to the rank processes: {type(exc).__name__}: {exc}. "
                "Fixture values of tests that use `dist` must be picklable in process modes; "
                "build the object in the test body, return "
                "fsdp_conformance.world.InRank(factory, ...) from the fixture to build it in "
                "each rank, or mark the test @pytest.mark.fsdp_mode('thread')."
            ) from None
    raise FixtureNotPicklable("the fixture values cannot be pickled together")  # pragma: no cover


def _rank_side_patches(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Replace ``monkeypatch`` fixture values by :class:`RankMonkeyPatch`: patches made in a
    rank body apply to the rank's objects and are undone there after the test."""
    monkeypatch = sys.modules.get("_pytest.monkeypatch")
    if monkeypatch is None:
        return kwargs
    return {
        name: RankMonkeyPatch() if isinstance(value, monkeypatch.MonkeyPatch) else value
        for name, value in kwargs.items()
    }


class Runtime:
    """Runs tests in ranks; owns the pooled rank sets and the session's temp directory."""

    def __init__(self, options: RuntimeOptions) -> None:
        self.options = options
        hooks.add_after_test(options.after_test)  # thread and launcher modes run here
        # private directory for rank sets, FileStores and per-test tmp dirs; removed by close()
        self._root: str | None = None
        # process mode: (world_size, backend, gpu_ids) -> live rank set, least recently used first
        self._pool: dict[tuple[int, str, tuple[int, ...]], RankSet] = {}
        # rank sets starting or running a test (out of the pool): `close` from another thread
        # (an interrupted CLI) kills them
        self._busy: set[RankSet] = set()
        self._gpu_total: int | None = None
        self._tests = 0
        atexit.register(self.close)

    # -------------------------------------------------------------------------

    @property
    def root(self) -> str:
        if self._root is None or not os.path.isdir(self._root):
            self._root = tempfile.mkdtemp(prefix="fsdp-conformance-")
        return self._root

    def gpu_total(self) -> int:
        if self._gpu_total is None:
            self._gpu_total = gpus.gpu_count()
        return self._gpu_total

    def close(self) -> None:
        """Stop every rank set and remove all temp files."""
        for rank_set in list(self._busy):
            rank_set.kill()
        for rank_set in self._pool.values():
            rank_set.close()
        self._pool.clear()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    # -------------------------------------------------------------------------

    def run(self, request: TestRequest) -> RunResult:
        """Run one test in its ranks and return the combined verdict."""
        if request.mode not in MODES:
            return _fail(f"unknown fsdp mode {request.mode!r}; use one of {', '.join(MODES)}")
        if request.world_size < 1:
            return _fail(f"world_size must be >= 1, got {request.world_size}")
        if not request.timeout > 0:
            return _fail(f"the timeout must be > 0 seconds, got {request.timeout!r}")
        total = self.gpu_total() if (request.gpus or self.options.backend != "gloo") else 0
        if request.gpus > total:
            return RunResult(
                report.Verdict(
                    SKIPPED,
                    f"needs {request.gpus} GPUs, {total} available"
                    + (" (CPU-only host)" if total == 0 else ""),
                ),
                {},
            )
        if request.mode == "thread":
            if request.gpus:
                return RunResult(
                    report.Verdict(SKIPPED, "thread mode runs ranks on CPU; this test needs GPUs"),
                    {},
                )
            return self._run_threads(request)
        # each rank gets its own GPU when the test needs GPUs, or (real GPUs only) when the
        # machine has one per rank and the backend is not forced to gloo
        want_gpus = request.gpus > 0 or (
            gpus.fake_gpu_count() is None
            and self.options.backend in (None, "nccl")
            and total >= request.world_size
        )
        if want_gpus and request.world_size > total:
            return RunResult(
                report.Verdict(
                    SKIPPED, f"needs {request.world_size} GPUs (one per rank), {total} available"
                ),
                {},
            )
        if self.options.backend == "nccl" and not want_gpus:
            return RunResult(
                report.Verdict(
                    SKIPPED,
                    f"backend nccl needs one GPU per rank: {request.world_size} needed, "
                    f"{total} available",
                ),
                {},
            )
        real_gpus = want_gpus and gpus.fake_gpu_count() is None
        backend = self.options.backend or ("nccl" if real_gpus else "gloo")
        lease = None
        if want_gpus:
            prefer = next(
                (key[2] for key in self._pool if key[:2] == (request.world_size, backend)), ()
            )
            try:
                lease = gpus.acquire_gpus(request.world_size, total, request.timeout, prefer)
            except TimeoutError as exc:
                return _fail(str(exc))
        try:
            return self._run_processes(request, backend, lease.ids if lease else ())
        finally:
            if lease is not None:
                lease.release()

    def _new_tmp_path(self) -> str:
        self._tests += 1
        return tempfile.mkdtemp(prefix=f"test{self._tests}-", dir=self.root)

    def _task(self, request: TestRequest, tmp_path: str) -> RankTask:
        return RankTask(
            target=request.target,
            kwargs_blob=pickle_kwargs(_rank_side_patches(request.kwargs)),
            test_id=request.test_id,
            seed=RANK_SEED,
            tmp_path=tmp_path,
            sys_path=list(sys.path),
            cwd=os.getcwd(),
            environ=dict(os.environ),
            impl=self.options.impl,
            timeout=request.timeout,
            wants_dist=request.wants_dist,
            after_test=tuple(self.options.after_test),
        )

    def _run_processes(
        self, request: TestRequest, backend: str, gpu_ids: tuple[int, ...]
    ) -> RunResult:
        tmp_path = self._new_tmp_path()
        try:
            blob = pickle.dumps(self._task(request, tmp_path))
            key = (request.world_size, backend, gpu_ids)
            fresh = request.mode == "process-fresh"
            rank_set = None if fresh else self._pool.pop(key, None)
            if rank_set is not None and not rank_set.healthy():
                rank_set.kill()
                rank_set = None
            if rank_set is None:
                if not fresh:
                    self._evict(request.world_size)
                rank_set = RankSet(
                    request.world_size, backend, self.root, request.timeout, request.mode, gpu_ids
                )
                self._busy.add(rank_set)
                try:
                    rank_set.start()
                except RankSetError as exc:
                    self._busy.discard(rank_set)
                    return _fail(f"could not start {request.world_size} ranks: {exc}")
            self._busy.add(rank_set)
            try:
                result = rank_set.run(blob, request.timeout)
            finally:
                self._busy.discard(rank_set)
                if fresh or rank_set.closed:
                    rank_set.close()
                else:
                    self._pool[key] = rank_set  # most recently used last
            verdict = report.summarize(
                result.outcomes, request.world_size, collectives.mismatch(result.collectives)
            )
            return RunResult(verdict, result.logs, result.notes)
        finally:
            shutil.rmtree(tmp_path, ignore_errors=True)

    def _evict(self, incoming: int) -> None:
        while (
            self._pool
            and sum(s.world_size for s in self._pool.values()) + incoming > MAX_POOLED_RANKS
        ):
            oldest = next(iter(self._pool))
            self._pool.pop(oldest).close()

    def _run_threads(self, request: TestRequest) -> RunResult:
        from fsdp_conformance.world import threads

        assert request.thread_body is not None, "thread mode needs a thread_body"
        tmp_path = self._new_tmp_path()
        try:
            outcomes, mismatch = threads.run_threaded(
                request.world_size,
                request.thread_body,
                timeout=request.timeout,
                tmp_path=tmp_path,
                seed=RANK_SEED,
                impl=self.options.impl,
                test_id=request.test_id,
            )
        finally:
            shutil.rmtree(tmp_path, ignore_errors=True)
        return RunResult(report.summarize(outcomes, request.world_size, mismatch), {})


def _fail(message: str) -> RunResult:
    return RunResult(report.Verdict(FAILED, message), {})


# The runtime of the running pytest session (set by the plugin), else a default one.
_active: Runtime | None = None
# whether _active belongs to a pytest session
_active_is_pytest = False


def set_active_runtime(runtime: Runtime | None, *, pytest_session: bool = False) -> None:
    """Make ``runtime`` the one :func:`get_runtime` returns (the plugin sets its own)."""
    global _active, _active_is_pytest
    _active = runtime
    _active_is_pytest = pytest_session and runtime is not None


def active_runtime() -> tuple[Runtime | None, bool]:
    """The runtime set by :func:`set_active_runtime` (None: none yet) and whether it is a pytest
    session's, without creating one (the plugin saves and restores it around a session)."""
    return _active, _active_is_pytest


def under_pytest() -> bool:
    """Whether the active runtime is a pytest session's (failures then use pytest.fail)."""
    return _active_is_pytest


def get_runtime() -> Runtime:
    """The pytest session's runtime, or one configured from the environment
    (``FSDP_CONFORMANCE_MODE``, ``FSDP_CONFORMANCE_TIMEOUT``, ``FSDP_CONFORMANCE_BACKEND``)."""
    global _active
    if _active is None:
        _active = Runtime(RuntimeOptions.from_env())
    return _active


def run_function(
    module: str,
    function: str,
    kwargs: dict[str, Any],
    *,
    world_size: int,
    timeout: float,
    impl: str,
    test_id: str,
    backend: str | None = "gloo",
) -> RunResult:
    """Call ``module.function(dist=..., **kwargs)`` once in ``world_size`` rank processes of a
    runtime of its own (outside pytest: the CLI's commands), closed afterwards.

    Returns:
        the ranks' combined result (``result.verdict``, ``result.output()``).
    """
    runtime = Runtime(
        RuntimeOptions(
            mode="process", timeout=timeout, world_size=world_size, impl=impl, backend=backend
        )
    )
    request = TestRequest(
        target=TestTarget(module, None, (), function),
        kwargs=kwargs,
        test_id=test_id,
        world_size=world_size,
        mode="process",
        timeout=timeout,
    )
    try:
        return runtime.run(request)
    finally:
        runtime.close()
