"""The probe behind ``fsdp-conformance coverage`` ([Note: coverage probe] in coverage.py): the
suite collected for an adapter, each cell's needs recorded by calling its body with a probe.
Imports torch (through the adapters), so the coverage command imports it only when it runs."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import tempfile
import types
from pathlib import Path
from typing import Any

from fsdp_conformance import checks
from fsdp_conformance.adapters import Adapter, UnsupportedFeatureError, normalize_config
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.cli.records import NO_LITTER
from fsdp_conformance.harness.gpus import gpus_needed


@dataclasses.dataclass
class Cell:
    """One collected cell and what it needs (see [Note: coverage probe])."""

    nodeid: str
    check: str  # "" for no registered check
    needs: tuple[str, ...]  # in the order asked
    blocked: str = ""  # why it skips whatever the adapter supports (a GPU, a refused value)
    probed: bool = True  # False: only the registry's and the case's features

    def missing(self, supports: Any) -> list[str]:
        """The features of `needs` that `supports(feature)` denies, sorted."""
        return sorted({feature for feature in self.needs if not supports(feature)})


class _Reached(BaseException):
    """The probed body made the adapter act (a BaseException: a misuse check's own ``except
    Exception`` must not take it for the implementation's answer)."""


class Granted(Adapter):
    """`adapter` as if it also supported the features `granted` (its declarations, no more)."""

    def __init__(self, adapter: Adapter, granted: frozenset[str] = frozenset()) -> None:
        self.adapter = adapter
        self.granted = granted
        self.name = adapter.name
        declared = adapter.declarations
        unsupported = {f: why for f, why in declared.unsupported.items() if f not in granted}
        self.declarations = dataclasses.replace(declared, unsupported=unsupported)

    def has(self, feature: str) -> bool:
        return adapter_features.supports(self, feature)


# the protocol's operations: calling one stops a probed body (wrap and wrapper record first)
_ACTIONS = frozenset(
    name for name in dir(Adapter) if not name.startswith("_") and callable(getattr(Adapter, name))
) - {"wrap", "wrapper"}


class _ProbeAdapter(Granted):
    """The adapter in a probed body: answers what it supports, records the features the body
    requires (`features.require`, swapped while probing) and stops the body at its first
    action."""

    def __init__(self, capabilities: Granted) -> None:
        super().__init__(capabilities.adapter, capabilities.granted)
        self.needs: list[str] = []
        self.blocked = ""  # a refused config value

    def __getattribute__(self, name: str) -> Any:
        if name not in _ACTIONS:
            return super().__getattribute__(name)

        def act(*args: Any, **kwargs: Any) -> Any:
            raise _Reached(name)

        return act

    def need(self, *features: str) -> None:
        self.needs.extend(f for f in features if f not in self.needs)

    def config_needs(self, config: dict[str, Any]) -> frozenset[str]:
        """The features `config` needs; a refused value blocks the cell."""
        features = adapter_features.wrap_features(**config)
        try:
            adapter_features.require_values(self, normalize_config(config))
        except UnsupportedFeatureError as error:
            self.blocked = self.blocked or str(error)
        return features

    def wrapper(self, *, process_group: Any = None, **config: Any) -> Any:
        self.need(*self.config_needs(config))
        return _ProbeWrap(self, config)

    def wrap(self, module: Any, *, process_group: Any = None, root: Any = None, **config: Any):
        self.need(*self.config_needs(config))
        raise _Reached("wrap")


class _ProbeWrap:
    """The probe's zoo `wrap`: records each nested config's needs and leaves the module
    unwrapped, so that a body builds its model and reaches the root wrap."""

    def __init__(self, adapter: _ProbeAdapter, config: dict[str, Any]) -> None:
        self.adapter = adapter
        self.config = config

    def __call__(self, module: Any, *, process_group: Any = None, root: Any = None, **overrides):
        self.adapter.need(*adapter_features.wrap_features(**{**self.config, **overrides}))
        return module

    def delay_before_reduction(self, delay: Any) -> Any:
        return contextlib.nullcontext()

    def delay_before_free(self, instance: Any, delay: Any) -> Any:
        return contextlib.nullcontext()


@contextlib.contextmanager
def _patched(*patches: tuple[Any, str, Any]):
    """While the block runs: each ``(owner, name, value)`` set, and no output."""
    import pytest

    output = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        for owner, name, value in patches:
            patch.setattr(owner, name, value)
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            yield


@contextlib.contextmanager
def _probe_cell(adapter: Any, check_id: str, case: Any = None):
    """``suite.verdict.cell`` while probing: the check's features are needs, no verdict."""
    adapter_features.require(adapter, *checks.get_check(check_id).features)
    yield


def _probe_require(adapter: Any, *features: str) -> None:
    """``features.require`` while probing: records a probe's needs, never raises for it."""
    if isinstance(adapter, _ProbeAdapter):
        adapter.need(*features)
    else:
        _REQUIRE(adapter, *features)


_REQUIRE = adapter_features.require


def _static_needs(item: Any, check: checks.Check | None) -> list[str]:
    """The registry's features and those of each parameter's ``wrap_config``."""
    needs = list(check.features) if check else []
    for value in getattr(getattr(item, "callspec", None), "params", {}).values():
        config = getattr(value, "wrap_config", None)
        if isinstance(config, dict):
            with contextlib.suppress(Exception):
                needs += sorted(adapter_features.wrap_features(**config))
    return needs


def _probe(item: Any, capabilities: Granted, world_size: int) -> Cell:
    """The cell of pytest item `item` ([Note: coverage probe])."""
    import pytest
    import torch

    from fsdp_conformance.harness.context import RankContext

    names = [cls.__name__ for cls in inspect.getmro(item.cls)] if item.cls else []
    check = checks.check_for_test(names, item.originalname)
    marker = item.get_closest_marker("world_size")
    ranks = int(marker.args[0]) if marker is not None and marker.args else world_size
    static = _static_needs(item, check)
    cell = Cell(item.nodeid, check.id if check else "", tuple(dict.fromkeys(static)))
    if (gpus := gpus_needed(item)) > torch.cuda.device_count():
        cell.blocked = f"needs {gpus} GPU(s), this host has {torch.cuda.device_count()}"
        return cell
    adapter = _ProbeAdapter(capabilities)
    group = types.SimpleNamespace(rank=lambda: 0, size=lambda: ranks)  # what zoo models ask
    unused = Path(tempfile.gettempdir()) / "fsdp-conformance-coverage-probe-unused"
    dist = RankContext(0, ranks, group, torch.device("cpu"), "gloo", unused, test_id=item.nodeid)
    params = dict(getattr(getattr(item, "callspec", None), "params", {}))
    function = getattr(item.cls(), item.originalname) if item.cls else item.function
    known = {**params, "fsdp_adapter": adapter, "dist": dist}
    names = list(inspect.signature(function).parameters)
    if any(name not in known for name in names):
        # a fixture only pytest can make: the registry's and the case's needs stand
        cell.probed = False
        return cell
    kwargs = {name: known[name] for name in names}
    from fsdp_conformance.suite import verdict

    try:
        with _patched(
            (verdict, "cell", _probe_cell), (adapter_features, "require", _probe_require)
        ):
            function(**kwargs)
    except _Reached:
        pass
    except UnsupportedFeatureError as error:
        adapter.need(error.feature)
    except pytest.skip.Exception as error:
        cell.blocked = " ".join(str(error.msg).split())
    except Exception:  # noqa: BLE001 -- the body needs ranks before it acts: static needs
        cell.probed = False
    cell.needs = tuple(dict.fromkeys([*cell.needs, *adapter.needs]))
    cell.blocked = cell.blocked or adapter.blocked
    return cell


class _Collector:
    """pytest plugin: probes every collected item at the end of the collection."""

    def __init__(self, capabilities: Granted, world_size: int) -> None:
        self.capabilities = capabilities
        self.world_size = world_size
        self.cells: list[Cell] = []
        self.errors: list[str] = []  # collection errors, one line each

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.errors.append(f"{report.nodeid}: {checks.report_line(report) or 'error'}")

    def pytest_collection_finish(self, session: Any) -> None:
        self.cells = [_probe(item, self.capabilities, self.world_size) for item in session.items]


def collect(
    impl: str, adapter: Any, coverage: str, world_size: int, granted: frozenset[str] = frozenset()
) -> list[Cell]:
    """The suite's cells for `impl`, as collected if `adapter` also supported `granted`;
    RuntimeError when the suite does not collect."""
    import pytest

    from fsdp_conformance.suite import configs

    capabilities = Granted(adapter, granted)
    collector = _Collector(capabilities, world_size)

    def dimensions(name: str) -> Any:  # configs.dimensions_for_impl, for `capabilities`
        return configs.supported_dimensions(capabilities)

    arguments = [
        "--collect-only", "-qq", *NO_LITTER, "-p", "no:xdist",
        "-o", "addopts=", "--pyargs", "fsdp_conformance.suite",
        f"--fsdp-impl={impl}", f"--fsdp-world-size={world_size}",
        f"--fsdp-coverage={coverage}",
    ]  # fmt: skip
    with _patched((configs, "dimensions_for_impl", dimensions)):
        code = pytest.main(arguments, plugins=[collector])
    if collector.errors or code not in (0, 5):
        errors = "; ".join(collector.errors)
        why = errors or "see pytest --collect-only --pyargs fsdp_conformance.suite"
        raise RuntimeError(f"the suite did not collect (pytest exit {int(code)}): {why}")
    return collector.cells
