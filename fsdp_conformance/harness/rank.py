"""The rank: :func:`run_task`, one test body in one rank the same in every mode (seed, build the
fixture values, call, classify the end as a :class:`RankOutcome`); :func:`reset_after_test`;
and :func:`main`, the loop of a rank process (started by ``harness/rankset.py``). Thread and
torchrun ranks call :func:`run_task` in place.

[Note: leaving a rank]
A rank process leaves with ``os._exit`` after flushing its output and sending its last
message: ranks sometimes abort during interpreter-exit garbage collection after
``destroy_process_group``, which would turn a passing test into a crash report.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import faulthandler
import functools
import gc
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import Any

from fsdp_conformance import checks, constants, device_handle
from fsdp_conformance._patching import patch_attribute
from fsdp_conformance.harness import properties, wire
from fsdp_conformance.harness.wire import RankOutcome, RankTask

# Environment variables the controller sets for a rank process.
ENV_FD = "FSDP_CONFORMANCE_CONN_FD"
ENV_RANK = "FSDP_CONFORMANCE_RANK"
ENV_WORLD_SIZE = "FSDP_CONFORMANCE_WORLD_SIZE"
ENV_STORE = "FSDP_CONFORMANCE_STORE"
ENV_BACKEND = "FSDP_CONFORMANCE_RANK_BACKEND"
ENV_GPU_IDS = "FSDP_CONFORMANCE_RANK_GPUS"
ENV_TIMEOUT = "FSDP_CONFORMANCE_RANK_TIMEOUT"
ENV_MODE = "FSDP_CONFORMANCE_RANK_MODE"
ENV_COLLECTIVE_SLOT = "FSDP_CONFORMANCE_COLLECTIVE_SLOT"
# what a test's environment must not override in its rank process
_KEPT_ENV = (ENV_RANK, ENV_WORLD_SIZE, ENV_BACKEND, ENV_GPU_IDS, ENV_MODE)
# Seconds between checks that the controller is still alive (an orphaned rank exits).
PARENT_POLL_S = 0.5

# Functions called after every test (the plugin passes the adapters' on_test_end).
_after_test: list[Callable[[], None]] = []
_after_test_lock = threading.Lock()


def add_after_test(functions: Iterable[Callable[[], None]]) -> None:
    """Register ``functions`` (each once) to run in this process after every test, before its
    non-default process groups are destroyed. They travel to rank processes by reference, so
    they must be importable (module level)."""
    with _after_test_lock:
        for function in functions:
            if not callable(function):
                raise TypeError(f"after_test hook {function!r} is not callable")
            if function not in _after_test:
                _after_test.append(function)


def run_after_test() -> None:
    with _after_test_lock:
        functions = list(_after_test)
    for function in functions:
        function()


def load_test_module(name: str, file: str | None) -> types.ModuleType:
    """Import the test module ``name`` from ``file`` with pytest's assertion rewriting; reuse
    it when this process already holds a rewritten copy from the same file (a copy imported
    plainly is replaced, so a bare ``assert`` explains itself in every rank)."""
    if name == "__main__":  # a unittest script run as `python test_x.py`
        name = "__mp_main__"
    module = sys.modules.get(name)
    rewritten = file is None or getattr(module, _REWRITTEN, False)
    if module is not None and rewritten and _same_file(getattr(module, "__file__", None), file):
        return module
    if file is None:
        return importlib.import_module(name)
    if parent := name.rpartition(".")[0]:
        with contextlib.suppress(ImportError):  # pytest's importlib mode: synthetic package names
            importlib.import_module(parent)  # for relative imports in the test module
    if (spec := importlib.util.spec_from_file_location(name, file)) is None or spec.loader is None:
        raise ImportError(f"cannot load test module {name!r} from {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        _exec_rewritten(module, file)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


_REWRITTEN = "__fsdp_conformance_rewritten__"  # set on a module executed with rewritten asserts


def _exec_rewritten(module: types.ModuleType, file: str) -> None:
    """Execute ``file``'s code in ``module`` with pytest's assertion rewriting (plain asserts
    when pytest's internals moved)."""
    with open(file, "rb") as source_file:
        source = source_file.read()
    tree = ast.parse(source, filename=file)
    try:
        from _pytest.assertion import rewrite, util

        rewrite.rewrite_asserts(tree, source, file, None)
        util._reprcompare = _reprcompare  # rich `==` explanations, as pytest shows them
    except Exception:  # noqa: BLE001  pytest internals moved: plain asserts still work
        tree = ast.parse(source, filename=file)
    setattr(module, _REWRITTEN, True)
    exec(compile(tree, file, "exec", dont_inherit=True), module.__dict__)  # noqa: S102


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    def exec_module(self, module: types.ModuleType) -> None:
        _exec_rewritten(module, self.path)


class _SuiteRewriter:
    """A meta-path finder importing the suite's test modules (``fsdp_conformance.suite``'s
    ``test_*.py``) with rewritten asserts in a rank, as pytest's import hook does in the
    controller: the package's own imports of them get the rewritten copies."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        package, _, leaf = name.rpartition(".")
        if not (package.startswith(_SUITE_PACKAGE) and leaf.startswith("test_")):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not str(spec.origin).endswith(".py"):
            return spec
        spec.loader = _RewritingLoader(name, spec.origin)
        return spec


_SUITE_PACKAGE = "fsdp_conformance.suite"


def _same_file(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a == b
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


class _AssertConfig:
    """The two things pytest's assertion explanations need from a Config."""

    def get_verbosity(self, verbosity_type: str | None = None) -> int:
        return 0

    def get_terminal_writer(self) -> Any:
        from _pytest._io import TerminalWriter

        return TerminalWriter(file=open(os.devnull, "w"))


def _reprcompare(op: str, left: Any, right: Any) -> str | None:
    """pytest's rich comparison explanation, or None. pytest's private ``assertrepr_compare``
    takes ``(config, op, left, right, ...)`` up to 9.1 and ``(op, left, right, *, verbose,
    highlighter, ...)`` from 9.2: every parameter is passed by name; an unknown required one
    drops the explanation (never a TypeError in the test)."""
    from _pytest.assertion import util

    try:
        function = util.assertrepr_compare
        arguments = {
            "config": _AssertConfig(),
            "op": op,
            "left": left,
            "right": right,
            "verbose": 0,
            "highlighter": lambda source, lexer="python": source,
            "assertion_text_diff_style": "ndiff",
        }
        kwargs = {}
        for name, parameter in inspect.signature(function).parameters.items():
            if name in arguments:
                kwargs[name] = arguments[name]
            elif parameter.default is inspect.Parameter.empty:
                return None  # a layout this module does not know
        lines = list(function(**kwargs) or ())
    except Exception:  # noqa: BLE001  pytest internals moved
        return None
    return "\n~".join(lines) if lines else None


def resolve_target(target: wire.TestTarget) -> Callable[..., Any]:
    """The callable that runs the test body (a function, a bound method, a TestCase's
    ``debug``)."""
    owner: Any = load_test_module(target.module_name, target.module_file)
    for attribute in target.class_path:
        owner = getattr(owner, attribute)
    if target.kind == "unittest":
        return owner(target.function_name).debug  # setUp, the method, tearDown
    if target.class_path:
        owner = owner()  # pytest instantiates test classes without arguments, per test
    return getattr(owner, target.function_name)


def seed_all(seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    if (numpy := sys.modules.get("numpy")) is not None:
        numpy.random.seed(seed)


def build_kwargs(
    values: dict[str, Any], ctx: Any, wants_dist: bool = True, monkeypatches: list | None = None
) -> dict[str, Any]:
    """Build ``InRank`` values in this rank and add ``dist`` if the test takes it; a
    ``RankMonkeyPatch`` becomes a ``pytest.MonkeyPatch`` appended to ``monkeypatches`` (the
    caller undoes it after the test)."""
    kwargs = {}
    for name, value in values.items():
        if isinstance(value, wire.RankMonkeyPatch):
            import pytest

            value = pytest.MonkeyPatch()
            if monkeypatches is not None:
                monkeypatches.append(value)
        elif isinstance(value, wire.InRank):
            try:
                wants_ctx = "dist" in inspect.signature(value.factory).parameters
            except (TypeError, ValueError):
                wants_ctx = False
            extra = {"dist": ctx} if wants_ctx else {}
            value = value.factory(*value.args, **value.kwargs, **extra)
        kwargs[name] = value
    if wants_dist:
        kwargs["dist"] = ctx
    return kwargs


def run_task(
    task: RankTask,
    ctx: Any,
    call: Callable[..., Any],
    values: dict[str, Any],
    monkeypatches: list | None = None,
) -> RankOutcome:
    """Run one test body in this rank (every mode): make ``ctx`` the current context, seed,
    call ``call`` (a pytest function with its fixture ``values``, or a unittest body) and
    classify how it ended, with the report properties it recorded."""
    _current_context.ctx = ctx
    device_handle.set_rank_device(ctx.device)
    try:
        seed_all(wire.RANK_SEED)
        start = time.perf_counter()
        with properties.collecting() as recorded:
            try:
                if task.target.kind == "unittest":
                    call()
                else:
                    call(**build_kwargs(values, ctx, task.wants_dist, monkeypatches))
            except BaseException as exc:  # noqa: BLE001  (everything is reported)
                outcome = classify_exception(ctx.rank, exc)
            else:
                outcome = RankOutcome(ctx.rank, wire.PASSED)
        outcome.duration = time.perf_counter() - start
        outcome.properties = [*recorded, (checks.PROPERTY_DEVICE, ctx.placement)]
        return outcome
    finally:
        _current_context.ctx = None
        device_handle.set_rank_device(None)


def classify_exception(rank: int, exc: BaseException) -> RankOutcome:
    """pytest's skip / xfail / fail, unittest's skip, else a failure with the user's
    traceback."""
    import unittest

    from _pytest.outcomes import Failed, Skipped, XFailed

    if isinstance(exc, Skipped):
        return RankOutcome(rank, wire.SKIPPED, message=str(exc.msg))
    if isinstance(exc, unittest.SkipTest):
        return RankOutcome(rank, wire.SKIPPED, message=str(exc))
    if isinstance(exc, XFailed):
        return RankOutcome(rank, wire.XFAILED, message=str(exc.msg))
    if isinstance(exc, Failed) and not exc.pytrace:
        return RankOutcome(rank, wire.FAILED, message=str(exc.msg))
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    message = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return RankOutcome(rank, wire.FAILED, message=message, traceback=format_user_traceback(exc))


_HARNESS_DIR = os.path.dirname(os.path.abspath(__file__))
_PLUGIN_FILE = os.path.join(os.path.dirname(_HARNESS_DIR), "plugin.py")
_COLLECTIVES_FILE = os.path.join(os.path.dirname(_HARNESS_DIR), "collective_observer.py")


def format_user_traceback(exc: BaseException) -> str:
    """``exc`` without the harness's leading frames, the collective observer's frames and
    unittest's frames (modules that set ``__unittest``)."""
    frames = []
    tb = exc.__traceback__
    leading = True
    while tb is not None:
        frame = tb.tb_frame
        filename = os.path.abspath(frame.f_code.co_filename)
        harness = os.path.dirname(filename) == _HARNESS_DIR or filename == _PLUGIN_FILE
        if not (leading and harness):
            leading = False
            if "__unittest" not in frame.f_globals and filename != _COLLECTIVES_FILE:
                frames.append((frame, tb.tb_lineno))
        tb = tb.tb_next
    report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    if frames:
        report.stack = traceback.StackSummary.extract(iter(frames))
    return "".join(report.format())


def reset_after_test(
    snapshot: Any, monkeypatches: list[Any], rank: int, destroy_groups: bool = True
) -> list[str]:
    """Undo what a test left in this interpreter: run the after-test functions, undo its
    monkeypatches, destroy its subgroups (unless ``destroy_groups`` is False: the caller does
    it once every rank is done), restore ``snapshot`` (``isolation.StateSnapshot``). Returns
    what could not be undone, one line each (the rank set is then replaced)."""
    from fsdp_conformance.harness import isolation

    run_after_test()
    while monkeypatches:
        monkeypatches.pop().undo()
    notes = []
    if destroy_groups:
        destroy_subgroups()
        notes = isolation.leftover_native_threads(snapshot, rank)
    snapshot.restore()
    if left := isolation.leftover_threads(snapshot):
        notes.append(f"the test left thread(s) running in rank {rank}: {', '.join(left)}")
    return notes


def destroy_subgroups() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        world = dist.distributed_c10d._world
        for group in list(world.pg_map):
            if group is not world.default_pg:
                dist.destroy_process_group(group)


# ProcessGroup methods gloo runs on host memory only (torch 2.8-2.15): its coalesced all-reduce
# refuses CUDA tensors, its coalesced all-gathers would hand device pointers to the host
# transport. Every other collective stages CUDA tensors through pinned host memory.
_GLOO_HOST_ONLY = (
    "allreduce_coalesced",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "all_gather_single_coalesced",
)


def skip_host_only_collectives() -> None:
    """In a rank on gloo with CUDA tensors (ranks sharing a GPU), a collective gloo cannot carry
    for CUDA tensors skips the test, naming it, instead of failing or crashing the rank."""
    import pytest
    import torch
    import torch.distributed as dist

    def on_cuda(value: Any) -> bool:
        if isinstance(value, (list, tuple)):
            return any(map(on_cuda, value))
        return isinstance(value, torch.Tensor) and value.is_cuda

    def guarded(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            if on_cuda(args):
                pytest.skip(
                    f"gloo does not carry CUDA tensors in ProcessGroup.{name} (torch "
                    f"{torch.__version__}); the ranks share a GPU here: give each rank its own "
                    "GPU (nccl) to run this"
                )
            return original(self, *args, **kwargs)

        return method

    for name in _GLOO_HOST_ONLY:
        if name in vars(dist.ProcessGroup):
            patch_attribute(
                dist.ProcessGroup,
                name,
                functools.partial(guarded, name),
                key="fsdp-conformance: gloo collectives on host memory only",
                written_for="torch 2.13.0",
            )


class _CurrentContext(threading.local):
    ctx: Any = None


# The rank context of the test running in this process / rank thread (RankTestCase reads it).
_current_context = _CurrentContext()


def current_context() -> Any:
    """The :class:`RankContext` of the test running in this rank, or None."""
    return _current_context.ctx


def _leave(code: int) -> None:
    """Flush and leave without interpreter teardown; see [Note: leaving a rank]."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # (a closed stream must not stop the exit)
            stream.flush()
    os._exit(code)


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            _leave(70)


class _RankProcess:
    """State of one rank process across the tests it runs."""

    def __init__(self) -> None:
        self.rank = int(os.environ[ENV_RANK])
        self.world_size = int(os.environ[ENV_WORLD_SIZE])
        self.backend = os.environ[ENV_BACKEND]
        self.mode = os.environ.get(ENV_MODE, "process")
        self.gpu_ids = tuple(int(g) for g in os.environ.get(ENV_GPU_IDS, "").split(",") if g)
        self.timeout = float(os.environ.get(ENV_TIMEOUT, str(constants.DEFAULT_TIMEOUT_S)))
        self.store_path = os.environ[ENV_STORE]
        self.conn = Connection(int(os.environ[ENV_FD]))
        self.base_sys_path: list[str] = list(sys.path)
        # monkeypatch fixtures made for the running test (undone after it)
        self.monkeypatches: list[Any] = []
        # the node id of the test run last (named when its groups outlive it)
        self.last_test = "the test before"

    def start(self) -> None:
        preimport()
        import torch
        import torch.distributed as dist

        from fsdp_conformance.harness import collectives, gpus, isolation

        self.device = torch.device("cpu")
        if self.gpu_ids and gpus.fake_gpu_count() is None:  # its own GPU, or one it shares
            self.device = torch.device("cuda", self.gpu_ids[self.rank])
            torch.cuda.set_device(self.device)
        if self.backend == "gloo" and self.device.type == "cuda":
            skip_host_only_collectives()
        # kept for re-creating the default group after a test destroyed it
        self.store = dist.FileStore(self.store_path, self.world_size)
        self.init_group(self.store)
        self.slot = collectives.CollectiveSlot.mapped(os.environ[ENV_COLLECTIVE_SLOT])
        collectives.set_process_slot(self.slot)
        collectives.install()
        self.base_environ = dict(os.environ)
        # restored after every test (harness/isolation.py)
        self.snapshot = isolation.StateSnapshot.take()
        gc.freeze()  # start-up's objects live on: collections after a test need not scan them

    def init_group(self, store: Any) -> None:
        import torch.distributed as dist

        nccl = self.backend == "nccl"
        dist.init_process_group(
            backend=self.backend,
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=self.timeout),
            **({"device_id": self.device} if nccl else {}),
        )
        self.group = dist.group.WORLD
        dist.barrier(**({"device_ids": [self.device.index]} if nccl else {}))

    def run(self, task: RankTask) -> RankOutcome:
        from fsdp_conformance.harness.context import RankContext

        os.environ.clear()
        os.environ.update(task.environ)
        for key in _KEPT_ENV:
            os.environ[key] = self.base_environ.get(key, "")
        if "CUDA_VISIBLE_DEVICES" in self.base_environ:  # the GPUs this process can use
            os.environ["CUDA_VISIBLE_DEVICES"] = self.base_environ["CUDA_VISIBLE_DEVICES"]
        os.environ.update(RANK=str(self.rank), LOCAL_RANK=str(self.rank))
        os.environ["WORLD_SIZE"] = str(self.world_size)
        sys.path[:] = task.sys_path + [p for p in self.base_sys_path if p not in task.sys_path]
        with contextlib.suppress(OSError):
            os.chdir(task.cwd)
        add_after_test(task.after_test)
        ctx = RankContext.of_task(
            task, rank=self.rank, world_size=self.world_size, group=self.group, device=self.device,
            backend=self.backend, mode=self.mode, gpu_ids=self.gpu_ids,
            init_method=f"file://{self.store_path}",
        )  # fmt: skip
        # importing the test is not test time: the timeout starts once every rank sent Started
        try:
            call = resolve_target(task.target)
            values = pickle.loads(task.kwargs_blob)
        except BaseException as exc:  # noqa: BLE001  reported like a failure of the body
            return classify_exception(self.rank, exc)
        self.conn.send(wire.Started())
        self.slot.reset()
        return run_task(task, ctx, call, values, self.monkeypatches)


# This process's rank state (None outside rank processes).
_process: _RankProcess | None = None


def preimport() -> None:
    """What a rank imports before its first test (not in that test's timeout); the zygote
    imports it once for every rank it forks."""
    import unittest  # noqa: F401

    import _pytest.assertion.rewrite
    import _pytest.outcomes  # noqa: F401
    import torch._dynamo  # noqa: F401  (every optimizer's first construction imports it)
    import torch.distributed  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    from fsdp_conformance.harness import collectives, isolation  # noqa: F401

    with contextlib.suppress(ImportError):
        import numpy  # noqa: F401
    if not any(isinstance(finder, _SuiteRewriter) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SuiteRewriter())


def main() -> None:
    """Rank process main loop: initialise, then run tests until told to exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller handles Ctrl-C and kills us
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the controller's hang dump
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    global _process
    process = _process = _RankProcess()
    try:
        process.start()
    except BaseException:  # noqa: BLE001
        process.conn.send(wire.StartupFailed(traceback.format_exc()))
        _leave(1)
    process.conn.send(wire.Ready(os.getpid()))
    import torch.distributed as dist

    from fsdp_conformance.harness import isolation

    while True:
        try:
            message = process.conn.recv()
        except (EOFError, OSError):
            _leave(0)
        message = wire.expect(message, "the controller", wire.RunTest, wire.ReinitGroup, wire.Exit)
        if isinstance(message, wire.Exit):
            _leave(0)
        # the last test's groups go only now that every rank has finished it: a rank tearing
        # a group down while another still connects to it fails that one (gloo: "Connection
        # closed by peer"); new_group does not wait for the other ranks
        destroy_subgroups()
        if isinstance(message, wire.ReinitGroup):
            try:
                process.init_group(dist.PrefixStore(f"reinit{message.generation}/", process.store))
                error = ""
            except BaseException:  # noqa: BLE001  reported; the controller replaces the set
                error = traceback.format_exc()
            process.conn.send(wire.GroupReinitialized(error))
            if error:
                _leave(72)
            continue
        left = isolation.leftover_native_threads(process.snapshot, process.rank, process.last_test)
        task = pickle.loads(message.task_blob)
        process.last_test = task.test_id
        outcome = process.run(task)
        try:
            reset = reset_after_test(process.snapshot, process.monkeypatches, process.rank, False)
            notes = tuple(left + reset)
        except BaseException:  # noqa: BLE001  a broken reset would poison the next test
            traceback.print_exc()
            notes = (f"rank {process.rank} could not restore its state after the test",)
        sys.stdout.flush()
        sys.stderr.flush()
        process.conn.send(wire.Finished(outcome, not notes, dist.is_initialized(), notes))
        if notes:
            _leave(71)
