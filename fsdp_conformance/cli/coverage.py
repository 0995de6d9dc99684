"""``fsdp-conformance coverage``: which cells an adapter would run or skip, and which
unsupported feature to implement next -- from a collection, not a run.

[Note: coverage probe]
A cell needs its check's features plus what its body asks for before it first makes the
adapter act: each body is called once with a *probe* for the adapter (an ``Adapter`` whose
declarations are the adapter's; it records what the body requires and stops the body at
``wrap`` or any other operation) and a ``dist`` without ranks. A body that cannot be probed
keeps its check's and case's features. A feature *unlocks* the cells that would run if the
adapter supported it too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import io
import json
import sys
import tempfile
import types
from collections import Counter
from pathlib import Path
from typing import Any

from fsdp_conformance import checks
from fsdp_conformance.adapters import Adapter, UnsupportedFeatureError, normalize_config
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.cli.records import NO_LITTER
from fsdp_conformance.cli.usage import (
    DEFAULT_COVERAGE,
    PROG,
    _add_impl,
    _subcommand,
    check_at_least,
    check_impl,
    check_output,
    write_json,
)
from fsdp_conformance.constants import COVERAGES

JSON_SCHEMA_VERSION = 1


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


class _Granted(Adapter):
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


class _ProbeAdapter(_Granted):
    """The adapter in a probed body: answers what it supports, records the features the body
    requires (`features.require`, swapped while probing) and stops the body at its first
    action."""

    def __init__(self, capabilities: _Granted) -> None:
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
def _swapped(owner: Any, name: str, value: Any):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


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


def _gpus_needed(item: Any, world_size: int) -> int:
    gpus = item.get_closest_marker("gpus")
    needed = int(gpus.args[0]) if gpus is not None and gpus.args else 0
    if item.get_closest_marker("cuda") is not None:
        needed = max(needed, world_size)
    return needed


def _static_needs(item: Any, check: checks.Check | None, adapter: Any) -> list[str]:
    """The registry's features and those of each parameter's ``wrap_config``."""
    needs = list(check.features) if check else []
    for value in getattr(getattr(item, "callspec", None), "params", {}).values():
        config = getattr(value, "wrap_config", None)
        if isinstance(config, dict):
            with contextlib.suppress(Exception):
                needs += sorted(adapter_features.wrap_features(**config))
    return needs


def _probe(item: Any, capabilities: _Granted, world_size: int) -> Cell:
    """The cell of pytest item `item` ([Note: coverage probe])."""
    import pytest
    import torch

    from fsdp_conformance.harness.context import RankContext

    names = [cls.__name__ for cls in inspect.getmro(item.cls)] if item.cls else []
    check = checks.check_for_test(names, item.originalname)
    marker = item.get_closest_marker("world_size")
    ranks = int(marker.args[0]) if marker is not None and marker.args else world_size
    static = _static_needs(item, check, capabilities.adapter)
    cell = Cell(item.nodeid, check.id if check else "", tuple(dict.fromkeys(static)))
    gpus = _gpus_needed(item, ranks)
    if gpus > torch.cuda.device_count():
        cell.blocked = f"needs {gpus} GPU(s), this host has {torch.cuda.device_count()}"
        return cell
    adapter = _ProbeAdapter(capabilities)
    dist = RankContext(
        rank=0,
        world_size=ranks,
        group=types.SimpleNamespace(rank=lambda: 0, size=lambda: ranks),  # what zoo models ask
        device=torch.device("cpu"),
        backend="gloo",
        tmp_path=Path(tempfile.gettempdir()) / "fsdp-conformance-coverage-probe-unused",
        test_id=item.nodeid,
    )
    params = dict(getattr(getattr(item, "callspec", None), "params", {}))
    function = getattr(item.cls(), item.originalname) if item.cls else item.function
    kwargs: dict[str, Any] = {}
    for name in inspect.signature(function).parameters:
        if name == "fsdp_adapter":
            kwargs[name] = adapter
        elif name == "dist":
            kwargs[name] = dist
        elif name in params:
            kwargs[name] = params[name]
        else:  # a fixture only pytest can make: the registry's and the case's needs stand
            cell.probed = False
            return cell
    from fsdp_conformance.suite import verdict

    try:
        with (
            _swapped(verdict, "cell", _probe_cell),
            _swapped(adapter_features, "require", _probe_require),
            _quiet(),
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


@contextlib.contextmanager
def _quiet():
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


class _Collector:
    """pytest plugin: probes every collected item at the end of the collection."""

    def __init__(self, capabilities: _Granted, world_size: int) -> None:
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
    impl: str,
    adapter: Any,
    *,
    coverage: str = DEFAULT_COVERAGE,
    world_size: int = 2,
    granted: frozenset[str] = frozenset(),
) -> list[Cell]:
    """The suite's cells for `impl`, as collected if `adapter` also supported `granted`;
    RuntimeError when the suite does not collect."""
    import pytest

    from fsdp_conformance.suite import configs

    capabilities = _Granted(adapter, granted)
    collector = _Collector(capabilities, world_size)

    def dimensions(name: str) -> Any:  # configs.dimensions_for_impl, for `capabilities`
        return configs.supported_dimensions(capabilities)

    arguments = [
        "--collect-only", "-qq", *NO_LITTER, "-p", "no:xdist",
        "-o", "addopts=", "--pyargs", "fsdp_conformance.suite",
        f"--fsdp-impl={impl}", f"--fsdp-world-size={world_size}",
        f"--fsdp-coverage={coverage}",
    ]  # fmt: skip
    with _swapped(configs, "dimensions_for_impl", dimensions), _quiet():
        code = pytest.main(arguments, plugins=[collector])
    if collector.errors or code not in (0, 5):
        raise RuntimeError(
            f"the suite did not collect (pytest exit {int(code)}): "
            + (
                "; ".join(collector.errors)
                or "see pytest --collect-only --pyargs fsdp_conformance.suite"
            )
        )
    return collector.cells


def report(impl: str, *, coverage: str = DEFAULT_COVERAGE, world_size: int = 2) -> dict[str, Any]:
    """The coverage of adapter `impl` as the JSON-ready dict ``--json`` writes (docs/cli.md)."""
    from fsdp_conformance.adapters import get_adapter
    from fsdp_conformance.suite import configs

    adapter = get_adapter(impl)
    problem = adapter_features.support_problem(adapter)
    cells = collect(impl, adapter, coverage=coverage, world_size=world_size)

    def runs(cell: Cell, supports: Any) -> bool:
        return problem is None and not cell.blocked and not cell.missing(supports)

    supports = _Granted(adapter).has
    now = [runs(cell, supports) for cell in cells]
    per_check: dict[str, dict[str, int]] = {}
    skipped_by: Counter = Counter()
    for cell, running in zip(cells, now):
        entry = per_check.setdefault(cell.check or "(unregistered)", {"run": 0, "skip": 0})
        entry["run" if running else "skip"] += 1
        if not running:
            missing = cell.missing(supports)
            skipped_by[problem or cell.blocked or (missing[0] if missing else "?")] += 1
    running_now = Counter(cell.check for cell, running in zip(cells, now) if running)
    unlocks = []
    dimensions = configs.supported_dimensions(_Granted(adapter))
    for feature, reason in sorted(dict(adapter.declarations.unsupported).items()):
        granted = _Granted(adapter, frozenset({feature}))
        then = cells  # collected again only where the feature changes the configs
        if configs.supported_dimensions(granted) != dimensions:
            then = collect(
                impl, adapter, coverage=coverage, world_size=world_size, granted=granted.granted
            )
        running_then = Counter(cell.check for cell in then if runs(cell, granted.has))
        gains = {
            check: running_then[check] - running_now[check]
            for check in sorted(set(running_then) | set(running_now))
            if running_then[check] != running_now[check]
        }
        total = sum(running_then.values()) - sum(running_now.values())
        if total > 0:
            unlocks.append({"feature": feature, "reason": reason, "cells": total, "checks": gains})
    unlocks.sort(key=lambda entry: (-entry["cells"], entry["feature"]))
    return {
        "schema": JSON_SCHEMA_VERSION,
        "impl": impl,
        "adapter": adapter.name,
        "coverage": coverage,
        "world_size": world_size,
        "support_problem": problem,
        "cells": len(cells),
        "run": sum(now),
        "skip": len(cells) - sum(now),
        "checks": dict(sorted(per_check.items())),
        "skipped_by": dict(skipped_by.most_common()),
        "unlocks": unlocks,
        "unprobed": sum(not cell.probed for cell in cells),
        "cell_list": [
            {
                "nodeid": cell.nodeid,
                "check": cell.check,
                "runs": running,
                "missing": cell.missing(supports),
                "blocked": cell.blocked,
            }
            for cell, running in zip(cells, now)
        ],
    }


def _family_counts(gains: dict[str, int]) -> str:
    families: Counter = Counter()
    for check, count in gains.items():
        families[check.partition(".")[0]] += count
    return ", ".join(f"{family} {count:+d}" for family, count in families.most_common())


def render_text(data: dict[str, Any]) -> str:
    """The report as the terminal shows it."""
    lines = [
        (
            f"adapter {data['adapter']!r} ({data['impl']}), coverage {data['coverage']}: "
            f"{data['cells']} cells collected, {data['run']} would run, {data['skip']} would skip"
        )
    ]
    if data["support_problem"]:
        lines.append(f"every cell skips: {data['support_problem']}")
    lines.append("")
    width = max((len(check) for check in data["checks"]), default=10)
    for check, counts in data["checks"].items():
        lines.append(f"  {check:<{width}}  {counts['run']:4d} run  {counts['skip']:4d} skip")
    if data["skipped_by"]:
        lines += ["", "skipped by (the first missing feature or the reason):"]
        lines += [f"  {count:4d}  {why}" for why, count in data["skipped_by"].items()]
    lines.append("")
    for entry in data["unlocks"]:
        lines.append(
            f"implement `{entry['feature']}` next: +{entry['cells']} "
            f"cell{'s' if entry['cells'] != 1 else ''} ({_family_counts(entry['checks'])})"
        )
    if not data["unlocks"]:
        lines.append("no single unsupported feature unlocks a cell")
    if data["unprobed"]:
        lines.append(
            f"({data['unprobed']} cells counted from their check's and case's features only)"
        )
    return "\n".join(lines)


def _coverage_command(args: argparse.Namespace) -> int:
    check_impl(args.impl)
    check_at_least(args.world_size, "--world-size")
    if args.json not in (None, "-"):
        check_output(args.json, "--json")
    try:
        data = report(args.impl, coverage=args.coverage, world_size=args.world_size)
    except RuntimeError as error:
        print(f"{PROG} coverage: {error}", file=sys.stderr)
        return 1
    if args.json == "-":
        print(json.dumps(data, indent=1))
        return 0
    if args.json is not None:
        write_json(args.json, data, indent=1)
    print(render_text(data))
    return 0


def add_parser(commands: Any, formatter: type[argparse.HelpFormatter]) -> None:
    parser = _subcommand(
        commands,
        formatter,
        "coverage",
        "which cells an adapter would run or skip, and what to implement next",
        "Collect the conformance suite for one adapter (no rank starts, nothing runs) and "
        "print how many cells would run and skip, per check, and for each unsupported "
        "feature how many cells implementing it would unlock, most first.",
        "fsdp-conformance coverage --impl torch-fsdp2",
        "cd examples && fsdp-conformance coverage --impl my_fsdp_adapter:ADAPTER --json -",
    )
    _add_impl(
        parser,
        "FSDP adapter: impl (default), torch-fsdp1, torch-fsdp2, fairscale, deepspeed or "
        "pkg.module:ATTR (the current directory and PYTHONPATH are searched)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=2,
        metavar="N",
        help="ranks for cells that do not fix their own world size, as `run` (default 2)",
    )
    parser.add_argument(
        "--coverage",
        choices=COVERAGES,
        default=DEFAULT_COVERAGE,
        help=f"parity configurations as `run` collects them (default {DEFAULT_COVERAGE})",
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="write the report as JSON to FILE (no FILE or '-': to stdout, instead of the text)",
    )
    parser.set_defaults(handler=_coverage_command)


__all__ = ["Cell", "add_parser", "collect", "render_text", "report"]
