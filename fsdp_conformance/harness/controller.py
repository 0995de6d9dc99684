"""The controller, the pytest side of the harness: options, the choice of backend and GPUs, and
:class:`Runtime`, which hands a test to a rank backend (``run(request, task)`` -> ``RunResult``,
``close()``: rank sets, ``launcher.TorchrunRanks``; ``threads.run_request``) and returns the
verdict combined from the ranks' outcomes. One :class:`Runtime` per pytest process;
:func:`get_runtime` gives ``RankTestCase`` the active one, or one from the environment.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from fsdp_conformance import constants
from fsdp_conformance.harness import gpus, rank, wire
from fsdp_conformance.harness.rankset import RankSet, RankSetError
from fsdp_conformance.harness.wire import FAILED, SKIPPED, RankTask, RunResult, TestTarget, not_run

# At most this many pooled rank processes stay alive (least recently used sets go first).
MAX_POOLED_RANKS = 8
# Backends --fsdp-backend / FSDP_CONFORMANCE_BACKEND accept.
BACKENDS = ("gloo", "nccl", "ucc", "mpi", "xccl")


class OptionError(ValueError):
    """An option or environment variable of the harness has a value it cannot use."""


def parse_timeout(value: object, source: str) -> float:
    """``value`` as a finite number of seconds > 0, else :class:`OptionError` naming ``source``
    (the option or variable). The other ``parse_*`` work the same way."""
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
    if value not in constants.MODES:
        raise OptionError(f"{source}={value!r}: use one of {', '.join(constants.MODES)}")
    return value


def parse_backend(value: str | None, source: str) -> str | None:
    """None / "": chosen per test."""
    if not value:
        return None
    if value not in BACKENDS:
        raise OptionError(
            f"{source}={value!r}: use one of {', '.join(BACKENDS)} (or leave it unset: gloo "
            "on CPU, nccl when each rank gets its own GPU)"
        )
    return value


def parse_world_size(value: object, source: str) -> int:
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
    mode: str = constants.DEFAULT_MODE
    # seconds a test may run in its ranks before it is failed with stack dumps
    timeout: float = constants.DEFAULT_TIMEOUT_S
    world_size: int = 2
    # --fsdp-impl, passed to the ranks as dist.impl
    impl: str = "impl"
    # None: gloo on CPU, nccl when each rank gets a GPU
    backend: str | None = None
    # module-level functions every rank calls after each test (rank.add_after_test)
    after_test: tuple[Callable[[], None], ...] = ()

    @classmethod
    def from_env(cls) -> RuntimeOptions:
        """Options from ``FSDP_CONFORMANCE_MODE`` / ``_TIMEOUT`` / ``_BACKEND``."""
        mode, timeout, backend = constants.ENV_MODE, constants.ENV_TIMEOUT, constants.ENV_BACKEND
        return cls(
            mode=parse_mode(os.environ.get(mode) or constants.DEFAULT_MODE, mode),
            timeout=parse_timeout(os.environ.get(timeout) or constants.DEFAULT_TIMEOUT_S, timeout),
            backend=parse_backend(os.environ.get(backend), backend),
        )


@dataclasses.dataclass
class TestRequest:
    """One test to run in ranks."""

    target: TestTarget
    # fixture values other than `dist`
    kwargs: dict[str, Any]
    test_id: str
    world_size: int
    mode: str
    timeout: float
    # GPUs the test needs (0: none required; it may still get nccl + GPUs when available)
    gpus: int = 0
    # the test callable in this process, for thread and torchrun ranks (a unittest body takes
    # no arguments); None: resolved from `target`
    function: Callable[..., Any] | None = None
    # whether the test function takes `dist` itself (else only through a fixture)
    wants_dist: bool = True


def pickle_kwargs(kwargs: dict[str, Any]) -> bytes:
    """Pickle fixture values for rank processes (``monkeypatch`` becomes a rank-side one),
    or :class:`FixtureNotPicklable` naming the fixture that cannot be sent and the fixes."""
    if (monkeypatch := sys.modules.get("_pytest.monkeypatch")) is not None:
        kwargs = {
            name: wire.RankMonkeyPatch() if isinstance(value, monkeypatch.MonkeyPatch) else value
            for name, value in kwargs.items()
        }
    with contextlib.suppress(Exception):  # find out which value it was, below
        return pickle.dumps(kwargs)
    for name, value in kwargs.items():
        try:
            pickle.dumps(value)
        except Exception as exc:  # noqa: BLE001
            raise FixtureNotPicklable(
                f"fixture {name!r} (a {type(value).__module__}.{type(value).__qualname__}) "
                f"cannot be sent to the rank processes: {type(exc).__name__}: {exc}. "
                "Fixture values of tests that use `dist` must be picklable in process modes; "
                "build the object in the test body, return "
                "fsdp_conformance.harness.InRank(factory, ...) from the fixture to build it in "
                "each rank, or mark the test @pytest.mark.fsdp_mode('thread')."
            ) from None
    raise FixtureNotPicklable("the fixture values cannot be pickled together")  # pragma: no cover


class _ProcessRanks:
    """``process`` and ``process-fresh`` modes: rank sets chosen by shape, kept for reuse."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        # (world_size, backend, gpu_ids) -> idle rank set, least recently used first
        self.pool: dict[tuple[int, str, tuple[int, ...]], RankSet] = {}
        # sets starting or running a test: `close` from another thread (an interrupted CLI)
        # kills them
        self.busy: set[RankSet] = set()

    def close(self) -> None:
        for rank_set in list(self.busy):
            rank_set.kill()
        for rank_set in self.pool.values():
            rank_set.close()
        self.pool.clear()

    def run(self, request: TestRequest, task: RankTask) -> RunResult:
        options, size = self.runtime.options, request.world_size
        total = self.runtime.gpu_total(request)
        # each rank gets its own GPU when the test needs GPUs, or (real GPUs only) when the
        # machine has one per rank and the backend is not forced to gloo; the ranks of a test
        # that needs GPUs, with fewer GPUs than ranks, share the GPUs it needs over gloo
        fake = gpus.fake_gpu_count() is not None
        want_gpus = request.gpus > 0 or (
            not fake and options.backend in (None, "nccl") and total >= size
        )
        share = want_gpus and size > total
        if options.backend == "nccl" and (share or not want_gpus):
            why = f"backend nccl needs one GPU per rank: {size} needed, {total} available"
            return not_run(SKIPPED, why)
        backend = options.backend or ("nccl" if want_gpus and not fake and not share else "gloo")
        task = dataclasses.replace(
            task,
            kwargs_blob=pickle_kwargs(request.kwargs),
            sys_path=list(sys.path),
            cwd=os.getcwd(),
            environ=dict(os.environ),
        )
        lease = None
        if want_gpus:
            prefer = next((key[2] for key in self.pool if key[:2] == (size, backend)), ())
            # a test that does not need GPUs runs on CPU while other workers hold them
            wait = request.timeout if request.gpus or options.backend == "nccl" else 0.0
            try:
                lease = gpus.acquire_gpus(request.gpus if share else size, total, wait, prefer)
            except TimeoutError as exc:
                if wait:
                    return not_run(FAILED, str(exc))
                backend = "gloo"  # no backend was forced (nccl waits above)
        gpu_ids = tuple(lease.ids[r % len(lease.ids)] for r in range(size)) if lease else ()
        try:
            return self._run(request, pickle.dumps(task), backend, gpu_ids)
        finally:
            if lease is not None:
                lease.release()

    def _run(
        self, request: TestRequest, blob: bytes, backend: str, gpu_ids: tuple[int, ...]
    ) -> RunResult:
        size, fresh = request.world_size, request.mode == "process-fresh"
        key = (size, backend, gpu_ids)
        rank_set = None if fresh else self.pool.pop(key, None)
        if rank_set is not None and not rank_set.healthy():
            rank_set.kill()
            rank_set = None
        if rank_set is None:
            while (
                not fresh
                and self.pool
                and (sum(s.world_size for s in self.pool.values()) + size > MAX_POOLED_RANKS)
            ):
                self.pool.pop(next(iter(self.pool))).close()  # least recently used first
            rank_set = RankSet(
                size, backend, self.runtime.root, request.timeout, request.mode, gpu_ids
            )
            self.busy.add(rank_set)
            try:
                rank_set.start()
            except RankSetError as exc:
                self.busy.discard(rank_set)
                return not_run(FAILED, f"could not start {size} ranks: {exc}")
        self.busy.add(rank_set)
        try:
            return rank_set.run(blob, request.timeout)
        finally:
            self.busy.discard(rank_set)
            if fresh or rank_set.closed:
                rank_set.close()
            else:
                self.pool[key] = rank_set  # most recently used last


class Runtime:
    """Runs tests in ranks; owns the rank backends and the session's temp directory.
    ``launcher`` (a ``launcher.LauncherEnv``): every test runs in place in a torchrun job."""

    def __init__(self, options: RuntimeOptions, launcher: Any = None) -> None:
        self.options = options
        rank.add_after_test(options.after_test)  # ranks that run in this process
        # for rank sets, FileStores and per-test tmp dirs
        self._root: str | None = None
        self._gpu_total: int | None = None
        self._tests = 0
        self._processes = _ProcessRanks(self)
        # the torchrun job's backend (launcher.TorchrunRanks)
        self.launcher: Any = None
        if launcher is not None:
            from fsdp_conformance.harness.launcher import TorchrunRanks

            self.launcher = TorchrunRanks(options, launcher)
        atexit.register(self.close)

    @property
    def root(self) -> str:
        if self._root is None or not os.path.isdir(self._root):
            self._root = tempfile.mkdtemp(prefix="fsdp-conformance-")
        return self._root

    def gpu_total(self, request: TestRequest) -> int:
        """The machine's GPUs; 0 without looking when gloo is forced and none are needed."""
        if not request.gpus and self.options.backend == "gloo":
            return 0
        if self._gpu_total is None:
            self._gpu_total = gpus.gpu_count()
        return self._gpu_total

    def close(self) -> None:
        """Stop every rank and remove all temp files."""
        self._processes.close()
        if self.launcher is not None:
            self.launcher.close()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def run(self, request: TestRequest) -> RunResult:
        """Run one test in its ranks and return the combined verdict."""
        task = RankTask(
            target=request.target, test_id=request.test_id, tmp_path="", impl=self.options.impl,
            timeout=request.timeout, wants_dist=request.wants_dist,
            after_test=tuple(self.options.after_test),
        )  # fmt: skip
        if self.launcher is not None:
            return self.launcher.run(request, task)
        if request.mode not in constants.MODES:
            modes = ", ".join(constants.MODES)
            return not_run(FAILED, f"unknown fsdp mode {request.mode!r}; use one of {modes}")
        if request.world_size < 1:
            return not_run(FAILED, f"world_size must be >= 1, got {request.world_size}")
        if not request.timeout > 0:
            return not_run(FAILED, f"the timeout must be > 0 seconds, got {request.timeout!r}")
        total = self.gpu_total(request)
        if request.gpus > total:
            where = " (CPU-only host)" if total == 0 else ""
            return not_run(SKIPPED, gpus.shortage(request.gpus, total, where))
        run = self._processes.run
        if request.mode == "thread":
            if request.gpus:
                return not_run(SKIPPED, "thread mode runs ranks on CPU; this test needs GPUs")
            from fsdp_conformance.harness.threads import run_request as run
        self._tests += 1
        tmp_path = tempfile.mkdtemp(prefix=f"test{self._tests}-", dir=self.root)
        try:
            return run(request, dataclasses.replace(task, tmp_path=tmp_path))
        finally:
            shutil.rmtree(tmp_path, ignore_errors=True)


# The runtime of the running pytest session (set by the plugin), else a default one, and
# whether it is a pytest session's.
_active: Runtime | None = None
_active_is_pytest = False


def set_active_runtime(runtime: Runtime | None, *, pytest_session: bool = False) -> None:
    global _active, _active_is_pytest
    _active = runtime
    _active_is_pytest = pytest_session and runtime is not None


def active_runtime() -> tuple[Runtime | None, bool]:
    """The runtime :func:`set_active_runtime` set (None: none yet) and whether it is a pytest
    session's, without creating one."""
    return _active, _active_is_pytest


def get_runtime() -> Runtime:
    """The pytest session's runtime, or one configured from the environment."""
    global _active
    if _active is None:
        _active = Runtime(RuntimeOptions.from_env())
    return _active


def function_request(
    module: str,
    function: str,
    kwargs: dict[str, Any],
    *,
    world_size: int,
    timeout: float,
    impl: str,
    test_id: str,
    backend: str | None = "gloo",
    gpus: int = 0,
) -> tuple[Runtime, TestRequest]:
    """A runtime of its own (close it after) and the request that calls
    ``module.function(dist=..., **kwargs)`` once in its ``world_size`` rank processes (the CLI's
    commands); ``gpus``: as ``TestRequest``'s."""
    options = RuntimeOptions("process", timeout, world_size, impl, backend)
    target = TestTarget(module, None, (), function)
    request = TestRequest(target, kwargs, test_id, world_size, "process", timeout, gpus)
    return Runtime(options), request


def run_function(module: str, function: str, kwargs: dict[str, Any], **options: Any) -> RunResult:
    """Run :func:`function_request`'s request (same arguments), then close its runtime."""
    runtime, request = function_request(module, function, kwargs, **options)
    try:
        return runtime.run(request)
    finally:
        runtime.close()
