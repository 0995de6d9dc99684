"""pytest plugin of fsdp-conformance (the ``pytest11`` entry point): options, markers, the
``dist`` fixture (a test taking it runs in every rank), and the verdicts of suite checks.
Import-light: torch is imported only in hooks, fixtures and rank processes.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from typing import Any

import pytest

from fsdp_conformance import constants
from fsdp_conformance.harness import signals as _signals


@dataclasses.dataclass
class PluginState:
    """Per-session plugin state (in ``config.stash``): the ``--fsdp-*`` options and more."""

    mode: str
    timeout: float
    world_size: int
    impl: str
    backend: str | None
    coverage: str | None = None  # None: each check's own default (suite.configs)
    runtime: Any = None  # harness.controller.Runtime (starts no process until needed)
    previous_runtime: Any = None  # the one active before this session (pytester runs)
    # what this session set in os.environ (--fsdp-accept-goldens), undone at its end
    environment: pytest.MonkeyPatch = dataclasses.field(default_factory=pytest.MonkeyPatch)
    launcher: Any = None  # harness.launcher.LauncherEnv when pytest runs inside torchrun & co.

    def get_runtime(self) -> Any:
        if self.runtime is None:
            from fsdp_conformance.harness import controller

            options = controller.RuntimeOptions(
                mode=self.mode, timeout=self.timeout, world_size=self.world_size, impl=self.impl,
                backend=self.backend, after_test=(adapters_test_end,),
            )  # fmt: skip
            self.runtime = controller.Runtime(options, launcher=self.launcher)
            self.previous_runtime = controller.active_runtime()
            controller.set_active_runtime(self.runtime, pytest_session=True)
        return self.runtime


STATE_KEY = pytest.StashKey[PluginState]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdp-conformance", "fsdp-conformance: running tests in N ranks")
    group.addoption(
        "--fsdp-mode", choices=constants.MODES,
        help="how ranks run: 'process' (reused rank processes, default), 'process-fresh' "
        "(new processes per test) or 'thread' (threads of the pytest process). "
        "Env: FSDP_CONFORMANCE_MODE.",
    )  # fmt: skip
    group.addoption(
        "--fsdp-timeout", metavar="SECONDS",
        help="fail a test still running in its ranks after this many seconds (> 0), with "
        f"every rank's Python stack (default {constants.DEFAULT_TIMEOUT_S:g}). Env: "
        "FSDP_CONFORMANCE_TIMEOUT.",
    )  # fmt: skip
    ranks = "ranks for tests without @pytest.mark.world_size (default 2)."
    group.addoption("--fsdp-world-size", default="2", metavar="N", help=ranks)
    group.addoption(
        "--fsdp-impl", default="impl", metavar="NAME",
        help="FSDP implementation under test: 'impl', 'torch-fsdp1', 'torch-fsdp2', "
        "'fairscale', 'deepspeed' or 'pkg.module:ATTR' (default 'impl').",
    )  # fmt: skip
    group.addoption(
        "--fsdp-backend", metavar="NAME",
        help="process group backend override ('gloo', 'nccl'); default: gloo on CPU, nccl "
        "when each rank gets its own GPU. Env: FSDP_CONFORMANCE_BACKEND.",
    )  # fmt: skip
    group.addoption(
        "--fsdp-coverage", choices=constants.COVERAGES,
        help="conformance suite: run every combination of a check's config dimensions "
        "('full') or a smaller set covering every pair of values ('pairwise'); default: "
        "what each check class says (the classes in fsdp_conformance.suite: full).",
    )  # fmt: skip
    group.addoption(
        "--fsdp-accept-goldens", action="store_true",
        help="conformance suite: write the prefetch-order goldens of the adapter under test "
        "into the source checkout instead of comparing (run with -p no:xdist). Env: "
        f"{constants.ENV_ACCEPT_GOLDENS}=1 or EXPECTTEST_ACCEPT=1.",
    )  # fmt: skip
    group.addoption(
        "--fsdp-launcher", default=os.environ.get(constants.ENV_LAUNCHER, "auto"),
        metavar="{auto,torchrun,none}",
        help="'auto' (default): when pytest runs inside torchrun (RANK, WORLD_SIZE, LOCAL_RANK, "
        "MASTER_ADDR, MASTER_PORT set) or a default process group exists, run each test in "
        "place in every process of the job; 'torchrun': require that; 'none': always spawn "
        "ranks. Env: FSDP_CONFORMANCE_LAUNCHER.",
    )  # fmt: skip


_MARKERS = (
    "world_size(n): run the test body in n ranks (needs the `dist` fixture)",
    "fsdp_mode(name): run this test's ranks as 'process', 'process-fresh' or 'thread'",
    "fsdp_timeout(seconds): per-test override of --fsdp-timeout",
    "gpus(n): the test needs n GPUs (skipped with a reason when fewer exist)",
    "cuda: the test computes on CUDA, on one GPU per rank (nccl) or one GPU its ranks share "
    + "(gloo; skipped on CPU-only hosts)",
)


def pytest_configure(config: pytest.Config) -> None:
    for marker in _MARKERS:
        config.addinivalue_line("markers", marker)
    from fsdp_conformance.harness import launcher

    options = _validated_options(config)
    launcher_env = launcher.configure(config, config.getoption("fsdp_launcher"))
    state = config.stash[STATE_KEY] = PluginState(**options, launcher=launcher_env)
    _signals.install_pytest_handler(config)
    if config.getoption("fsdp_accept_goldens"):  # the ranks get this environment with each test
        state.environment.setenv(constants.ENV_ACCEPT_GOLDENS, "1")
    # created now (torch-free, no process yet) so that FSDPTest classes use the session options
    runtime = state.get_runtime()
    if launcher_env is not None:
        config.pluginmanager.register(launcher.LauncherPlugin(runtime.launcher), "fsdp-launcher")


def _validated_options(config: pytest.Config) -> dict[str, Any]:
    """The session options, each checked where it enters (command line, else environment);
    pytest.UsageError naming the option or variable and what it accepts."""
    from fsdp_conformance.harness import controller as runtime

    def pick(option: str, env: str, default: Any) -> tuple[Any, str]:
        if (value := config.getoption(option)) is None and os.environ.get(env):
            return os.environ[env], env
        return default if value is None else value, "--" + option.replace("_", "-")

    try:
        return {
            "mode": runtime.parse_mode(
                *pick("fsdp_mode", constants.ENV_MODE, constants.DEFAULT_MODE)
            ),
            "timeout": runtime.parse_timeout(
                *pick("fsdp_timeout", constants.ENV_TIMEOUT, constants.DEFAULT_TIMEOUT_S)
            ),
            "world_size": runtime.parse_world_size(
                config.getoption("fsdp_world_size"), "--fsdp-world-size"
            ),
            "impl": _validated_impl(config.getoption("fsdp_impl")),
            "backend": runtime.parse_backend(*pick("fsdp_backend", constants.ENV_BACKEND, None)),
            "coverage": config.getoption("fsdp_coverage"),
        }
    except runtime.OptionError as error:
        raise pytest.UsageError(str(error)) from None


def _validated_impl(name: str) -> str:
    """``--fsdp-impl``: a built-in adapter whose optional package imports, or ``pkg.mod:ATTR``
    (resolved in the ranks); else pytest.UsageError."""
    if name not in constants.BUILTIN_ADAPTERS and ":" not in name:
        raise pytest.UsageError(
            f"--fsdp-impl {name!r}: unknown adapter; use one of "
            f"{', '.join(constants.BUILTIN_ADAPTERS)} or 'pkg.module:ATTR' naming an Adapter "
            "instance, subclass or factory"
        )
    from fsdp_conformance.harness.extras import missing_extra

    if (problem := missing_extra(name)) is not None:
        raise pytest.UsageError(f"--fsdp-impl {name}: {problem}")
    if ":" in name:
        _refuse_removed_names(name)
    return name


def _refuse_removed_names(name: str) -> None:
    """pytest.UsageError (one line, before any worker or rank starts) when adapter `name` uses
    a name removed from the adapter protocol; its other errors are the ranks' to report."""
    from fsdp_conformance.adapters import get_adapter
    from fsdp_conformance.adapters.registry import RemovedNameError

    try:
        get_adapter(name)
    except RemovedNameError as error:
        raise pytest.UsageError(f"--fsdp-impl {name}: {error}") from None
    except Exception:  # noqa: BLE001 -- reported by the ranks, as at collection
        pass


def pytest_unconfigure(config: pytest.Config) -> None:
    _signals.uninstall_pytest_handler(config)
    if (state := config.stash.get(STATE_KEY, None)) is not None:
        state.environment.undo()
    if state is not None and state.runtime is not None:
        from fsdp_conformance.harness import controller

        state.runtime.close()
        if controller.active_runtime()[0] is state.runtime:
            previous, was_pytest = state.previous_runtime or (None, False)
            controller.set_active_runtime(previous, pytest_session=was_pytest)
        state.runtime = None


def _marker_arg(item: pytest.Item, name: str, default: Any) -> Any:
    marker = item.get_closest_marker(name)
    return marker.args[0] if marker is not None and marker.args else default


def _world_size(item: pytest.Item, state: PluginState) -> int:
    # under a launcher, a test that does not fix its size uses the whole job
    default = state.world_size if state.launcher is None else state.launcher.world_size
    return int(_marker_arg(item, "world_size", default))


def _mode(item: pytest.Item, state: PluginState) -> str:
    if (mode := _marker_arg(item, "fsdp_mode", state.mode)) not in constants.MODES:
        raise pytest.UsageError(
            f"{item.nodeid}: fsdp_mode({mode!r}) is not one of {', '.join(constants.MODES)}"
        )
    return mode


def _timeout(item: pytest.Item, state: PluginState) -> float:
    from fsdp_conformance.harness import controller

    value = _marker_arg(item, "fsdp_timeout", state.timeout)
    try:
        return controller.parse_timeout(value, "fsdp_timeout marker")
    except controller.OptionError as error:
        raise pytest.UsageError(f"{item.nodeid}: {error}") from None


@pytest.fixture
def dist(request: pytest.FixtureRequest) -> Any:
    """The rank context: ``rank``, ``world_size``, ``group``, ``device``, ``backend``,
    ``tmp_path``, ``impl``, ``barrier()``. The test body runs in every rank."""
    from fsdp_conformance.harness.context import DistPlaceholder

    state = request.config.stash[STATE_KEY]
    return DistPlaceholder(_world_size(request.node, state), _mode(request.node, state), state.impl)


@pytest.fixture(scope="session")
def fsdp_impl(request: pytest.FixtureRequest) -> str:
    """The --fsdp-impl name of the FSDP implementation under test."""
    return request.config.stash[STATE_KEY].impl


def adapters_test_end() -> None:
    """``Adapter.on_test_end`` of every adapter resolved here (in each rank after every test)."""
    from fsdp_conformance.adapters import registry

    registry.notify_test_end()


def resolve_adapter(name: str) -> Any:
    """``get_adapter(name)``, called inside each rank (the ``fsdp_adapter`` fixture's factory)."""
    from fsdp_conformance.adapters import get_adapter

    return get_adapter(name)


@pytest.fixture
def fsdp_adapter(fsdp_impl: str, dist: Any) -> Any:
    """The adapter of the FSDP under test (``--fsdp-impl``), resolved inside each rank (an
    ``InRank``: adapters are never pickled, so ask for it in the test function itself).
    Override ``fsdp_impl`` to point a test class at another adapter."""
    from fsdp_conformance.harness.wire import InRank

    return InRank(resolve_adapter, fsdp_impl)


@pytest.fixture(scope="session")
def fsdp_coverage(request: pytest.FixtureRequest) -> str | None:
    """The --fsdp-coverage choice ('full' or 'pairwise'), or None when not given."""
    return request.config.stash[STATE_KEY].coverage


def _target(item: pytest.Function) -> Any:
    from fsdp_conformance.harness.wire import TestTarget

    module = item.module
    return TestTarget(
        module_name=module.__name__,
        module_file=getattr(module, "__file__", None),
        class_path=tuple(node.name for node in item.listchain() if isinstance(node, pytest.Class)),
        function_name=item.originalname,
    )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    # tests that get `dist` only through another fixture run in the ranks too
    if "dist" not in pyfuncitem.fixturenames:
        return None
    from fsdp_conformance.harness import controller, gpus
    from fsdp_conformance.harness.wire import FAILED, SKIPPED, XFAILED

    state = pyfuncitem.config.stash[STATE_KEY]
    argnames = pyfuncitem._fixtureinfo.argnames
    request = controller.TestRequest(
        target=_target(pyfuncitem),
        kwargs={name: pyfuncitem.funcargs[name] for name in argnames if name != "dist"},
        test_id=pyfuncitem.nodeid,
        world_size=_world_size(pyfuncitem, state),
        mode=_mode(pyfuncitem, state),
        timeout=_timeout(pyfuncitem, state),
        gpus=gpus.gpus_needed(pyfuncitem),
        function=pyfuncitem.obj,
        wants_dist="dist" in argnames,
    )
    try:
        result = state.get_runtime().run(request)
    except controller.FixtureNotPicklable as exc:
        pytest.fail(str(exc), pytrace=False)
    pyfuncitem.user_properties.extend(result.verdict.properties)
    sys.stdout.write(result.output())
    if result.notes:
        pyfuncitem.add_report_section("call", "fsdp-conformance", "\n".join(result.notes))
    verdict = result.verdict
    if verdict.status == FAILED:
        pytest.fail(verdict.message, pytrace=False)
    if verdict.status == SKIPPED:
        pytest.skip(verdict.message)
    if verdict.status == XFAILED:
        pytest.xfail(verdict.message)
    return True


# Verdicts of suite checks (checks.py, suite/verdict.py)
_RESULT_KEY = pytest.StashKey[Any]()  # the item's checks.Result decided at collection
_CHECK_KEY = pytest.StashKey[Any]()  # the item's checks.Check (None: no registered check)
_UNRESOLVED = object()


def _registered_check(item: pytest.Item) -> Any:
    if _CHECK_KEY not in item.stash:
        from fsdp_conformance import checks

        cls = getattr(item, "cls", None)
        names = [klass.__name__ for klass in cls.__mro__] if cls is not None else []
        function = getattr(item, "originalname", item.name)
        item.stash[_CHECK_KEY] = checks.check_for_test(names, function) if names else None
    return item.stash[_CHECK_KEY]


def _uses_session_impl(item: pytest.Item) -> bool:
    """Whether the item's ``fsdp_impl`` and ``fsdp_adapter`` fixtures are this plugin's."""
    definitions = getattr(item, "_fixtureinfo", None)
    if definitions is None or "fsdp_impl" not in definitions.name2fixturedefs:
        return False
    return all(
        getattr(chain[-1].func, "__module__", None) == __name__
        for name, chain in definitions.name2fixturedefs.items()
        if name in ("fsdp_impl", "fsdp_adapter") and chain
    )


def _session_adapter(config: pytest.Config) -> Any:
    """The session's adapter, or None when it does not resolve (the ranks report the error)."""
    from fsdp_conformance.adapters import get_adapter

    try:
        return get_adapter(config.stash[STATE_KEY].impl)
    except Exception:  # noqa: BLE001 -- resolution errors are reported by the ranks
        return None


def _not_applicable(adapter: Any, check: Any) -> Any:
    """The not-applicable ``checks.Result`` of ``check`` on ``adapter`` (outside its support
    range, or lacking a feature the check needs), or None."""
    from fsdp_conformance import checks
    from fsdp_conformance.adapters import UnsupportedFeatureError
    from fsdp_conformance.adapters import features as adapter_features

    if (problem := adapter_features.support_problem(adapter)) is not None:
        reason = f"adapter {adapter.name!r}: {problem}"
        return checks.Result(check.id, checks.NOT_APPLICABLE, reason, feature="version")
    try:
        adapter_features.require(adapter, *check.features)
    except UnsupportedFeatureError as error:
        return checks.Result(check.id, checks.NOT_APPLICABLE, str(error), feature=error.feature)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A cell not applicable to the adapter is skipped here, its verdict recorded. The rank
    processes' zygote imports the installed suite's collected modules before it forks."""
    from fsdp_conformance.harness import zygote

    modules = {getattr(getattr(item, "module", None), "__name__", "") for item in items}
    zygote.preload(sorted(name for name in modules if name.startswith(_SUITE)))
    adapter: Any = _UNRESOLVED  # resolved once, at the first registered check
    for item in items:
        if (check := _registered_check(item)) is None or not _uses_session_impl(item):
            continue
        if adapter is _UNRESOLVED:
            adapter = _session_adapter(config)
        if adapter is None:
            return
        if (result := _not_applicable(adapter, check)) is not None:
            item.stash[_RESULT_KEY] = result
            item.add_marker(pytest.mark.skip(reason=result.reason))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A registered check's report carries its ``checks.Result`` as properties: the one its cell
    recorded (or collection decided), or the one pytest's outcome implies (a fixture error, a
    dead or hung rank)."""
    from fsdp_conformance import checks
    from fsdp_conformance.harness import properties

    if call.when == "call":
        item.user_properties.extend(properties.take_pending())
    report = yield
    if (check := _registered_check(item)) is None or (report.when != "call" and report.passed):
        return report
    recorded = item.stash.get(_RESULT_KEY, None) or checks.Result.from_properties(
        item.user_properties
    )
    result = dataclasses.replace(
        checks.Result.of_report(check.id, report, recorded), check=check.id
    )
    if result.verdict in (checks.FAIL, checks.DEVIATION):
        result = dataclasses.replace(result, rerun=_rerun_line(item))
    kept = [(n, v) for n, v in item.user_properties if not n.startswith("fsdp_")]
    item.user_properties[:] = kept + result.properties()
    report.user_properties = list(item.user_properties)
    return report


_SUITE = "fsdp_conformance.suite."


def _rerun_line(item: pytest.Item) -> str:
    """The shell line running ``item`` alone from any directory: a suite cell under the CLI as
    ``<the CLI's prefix, constants.ENV_CLI_RERUN> --cell <Class>::<test>[<id>]``, else pytest."""
    from fsdp_conformance import checks

    state = item.config.stash[STATE_KEY]
    module = getattr(getattr(item, "module", None), "__name__", "")
    test = item.nodeid.partition("::")[2]
    if (prefix := os.environ.get(constants.ENV_CLI_RERUN)) and module.startswith(_SUITE):
        return f"{prefix} --cell {shlex.quote(test)}"
    installed = module.startswith("fsdp_conformance.")
    target = ["--pyargs", f"{module}::{test}"] if installed else [f"{item.path}::{test}"]
    options = [f"--fsdp-impl={state.impl}"]
    if state.world_size != 2:
        options.append(f"--fsdp-world-size={state.world_size}")
    if state.coverage:
        options.append(f"--fsdp-coverage={state.coverage}")
    return checks.shell_line(state.impl, ["python", "-m", "pytest", *target, *options])
