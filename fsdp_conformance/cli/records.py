"""pytest plugin the CLI loads with ``-p``: one JSON line per finished test, for the matrix.

The controlling pytest process appends to the file ``FSDP_CONFORMANCE_CLI_RESULTS`` names
(inert without it) records ``{"event": "collected", "count": N}``, ``{"event": "test",
"nodeid", "outcome", "detail", "duration", "check_id", "verdict", "reason", "rerun",
"measured"}``,
``{"event": "collect_error", "nodeid", "detail"}`` and ``{"event": "usage_error", "detail"}``.
Every field comes from the cell's ``checks.Result``; no message text is parsed.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import pytest

from fsdp_conformance import checks, constants

# Plugins that would leave files in the user's working directory
NO_LITTER = ("-p", "no:cacheprovider", "-p", "no:benchmark")
# hypothesis' plugin imports hypothesis at the end of every session (start-up time); the
# suite's fuzz check drives hypothesis itself, in its ranks
_UNUSED = ("-p", "no:hypothesispytest")


SUITE = "fsdp_conformance.suite"


def suite_command(impl: str, *pytest_args: str, targets: Sequence[str] = (SUITE,)) -> list[str]:
    """The command line of a quiet pytest run of the installed suite (or its ``targets``,
    ``--pyargs`` node ids) on ``impl`` with this plugin (no user ``addopts``, no littering
    plugins), followed by ``pytest_args``."""
    return [
        sys.executable, "-m", "pytest", "--pyargs", *targets,
        "-p", "fsdp_conformance.cli.records", *NO_LITTER, *_UNUSED,
        "-o", "addopts=", "-q", f"--fsdp-impl={impl}", *pytest_args,
    ]  # fmt: skip


def suite_environment(results: str) -> dict[str, str]:
    """This process's environment as for a fresh pytest session (not a worker of an outer
    xdist run), writing its records to ``results``."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_TEST"))
    }
    env[constants.ENV_CLI_RESULTS] = results
    return env


def detail(result: checks.Result, phase: str = "call") -> str:
    """The matrix's text of a cell: its failure (naming a setup or teardown phase), skip reason,
    or a deviation's failure and reason."""
    if result.verdict == checks.FAIL and phase != "call":
        return f"error in {phase}: {result.reason}"
    if result.verdict == checks.DEVIATION and result.failure:
        return f"{result.failure} -- known deviation ({result.check}): {result.reason}"
    return result.reason


def _append(path: str, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as stream:
        stream.write(json.dumps(record) + "\n")


class _Recorder:
    """The plugin object: writes each test's record when its teardown reports."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pending: dict[str, dict[str, Any]] = {}  # nodeid -> record so far (until teardown)
        self.collected_seen = False  # under xdist every worker announces its collection
        self.decided: set[str] = set()  # node ids whose record a phase has set

    def _collected(self, count: int) -> None:
        if not self.collected_seen:
            self.collected_seen = True
            _append(self.path, {"event": "collected", "count": count})

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if not session.config.pluginmanager.has_plugin("dsession"):  # xdist reports below
            self._collected(len(session.items))

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        self._collected(len(ids))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            line = checks.report_line(report) or "failed (no message)"
            _append(self.path, {"event": "collect_error", "nodeid": report.nodeid, "detail": line})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        record = self.pending.setdefault(
            report.nodeid,
            {"event": "test", "nodeid": report.nodeid, "outcome": "pass", "detail": "",
             "duration": 0.0},
        )  # fmt: skip
        record["duration"] += getattr(report, "duration", 0.0) or 0.0
        if report.when == "call" or not report.passed:  # a phase that says something
            result = checks.Result.from_properties(report.user_properties)
            if result is None:  # no registered check: the outcome decides
                result = checks.Result.of_report("", report)
            # the first phase that says decides; a later one only by failing
            decided = record["nodeid"] in self.decided
            if not decided or (result.verdict == checks.FAIL and record["outcome"] != "fail"):
                self.decided.add(record["nodeid"])
                text = detail(result, report.when)
                device = dict(report.user_properties).get(checks.PROPERTY_DEVICE, "cpu")
                if not device.startswith("cpu"):  # the default goes unsaid; a GPU is named
                    text = f"{text} [ranks on {device}]".lstrip()
                record.update(
                    outcome=result.outcome, detail=text,
                    check_id=result.check, verdict=result.verdict, reason=result.reason,
                    rerun=result.rerun or "", measured=json.loads(result.measured or "null"),
                )  # fmt: skip
        if report.when == "teardown":
            self.decided.discard(report.nodeid)
            _append(self.path, self.pending.pop(report.nodeid))


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get(constants.ENV_CLI_RESULTS)
    if path and not hasattr(config, "workerinput"):  # the controller (or the only process)
        config.pluginmanager.register(_Recorder(path), "fsdp-conformance-cli-recorder")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The cells of world sizes other than the run's go first, the smallest group first: xdist
    hands each worker a run of consecutive cells, so that one worker starts a rank set of such
    a size rather than every worker."""
    default = str(config.getoption("fsdp_world_size"))

    def size(item: pytest.Item) -> str:
        marker = item.get_closest_marker("world_size")
        return str(marker.args[0]) if marker is not None and marker.args else default

    counts = collections.Counter(map(size, items))
    items.sort(key=lambda item: (size(item) == default, counts[size(item)], size(item)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported lives as long as the session: frozen, the collections during
    the run (and the five at its end) no longer walk it."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config) -> Any:
    """A usage error (raised while pytest configures or collects) as a record."""
    try:
        return (yield)
    except pytest.UsageError as error:
        path = os.environ.get(constants.ENV_CLI_RESULTS)
        if path and not hasattr(config, "workerinput"):
            _append(path, {"event": "usage_error", "detail": " ".join(str(error).split())})
        raise
