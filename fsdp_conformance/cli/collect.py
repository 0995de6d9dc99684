"""pytest plugin the CLI loads with ``-p``: one JSON line per finished test, for the matrix.

``fsdp-conformance run`` starts pytest with ``-p fsdp_conformance.cli.collect`` and the
environment variable ``FSDP_CONFORMANCE_CLI_RESULTS`` naming a file; this plugin appends to it

    {"event": "collected", "count": 165}
    {"event": "test", "nodeid": ..., "outcome": "pass", "detail": "", "duration": 1.2,
     "check_id": "parity.ddp", "verdict": "pass", "reason": ""}
    {"event": "collect_error", "nodeid": ..., "detail": "ImportError: ..."}

as results arrive, so the CLI can show progress while pytest runs and build the matrix when it
ends. Only the controlling pytest process writes (under pytest-xdist the workers' reports reach
the controller through ``pytest_runtest_logreport``). Without the variable the plugin is inert.

Outcomes: ``pass``, ``fail`` (an error in setup or teardown is a failure too), ``xfail``,
``xpass`` (a non-strict expected failure that passed; a strict one fails), ``skip``. ``detail``
is the first assertion message of a failure, the reason of a skip or xfail. ``check_id``,
``verdict`` and ``reason`` are the registered check's verdict, read from the report's properties
(``fsdp_conformance.checks.PROPERTY_*``, recorded by suite/verdict.py and the plugin) -- data,
never parsed from messages; absent for a test that is no registered check.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

import pytest

from fsdp_conformance import checks, vocab

ENV_RESULTS = vocab.ENV_CLI_RESULTS
# Plugins blocked in the CLI's own pytest runs: they would leave files in the user's cwd
NO_LITTER = ("-p", "no:cacheprovider", "-p", "no:benchmark")


def suite_command(impl: str, *pytest_args: str) -> list[str]:
    """The command line of a pytest run of the installed suite on ``impl`` with this plugin
    (no user ``addopts``, quiet, none of the plugins that write into the working directory:
    pytest's cache, pytest-benchmark's ``.benchmarks``), followed by ``pytest_args``."""
    return [
        sys.executable, "-m", "pytest", "--pyargs", "fsdp_conformance.suite",
        "-p", "fsdp_conformance.cli.collect", *NO_LITTER,
        "-o", "addopts=", "-q", f"--fsdp-impl={impl}", *pytest_args,
    ]  # fmt: skip


def suite_environment(results: str) -> dict[str, str]:
    """The environment of that run: this process's, as a fresh pytest session (not a worker of
    an outer pytest-xdist run, e.g. the CLI's own tests), writing its records to ``results``."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_TEST"))
    }
    env[ENV_RESULTS] = results
    return env

# Lines of a failure report that carry the message (pytest prefixes them with "E   ")
_ERROR_LINE = re.compile(r"^E\s+(.*)$")
# An exception line: "AssertionError: ...", "torch.distributed.DistBackendError: ..."
_EXCEPTION_LINE = re.compile(r"^(?:[a-z_]\w*\.)*[A-Z]\w*: ")
# How a rank failure starts: "rank 1 of 2 failed: AssertionError: ..."
_RANK_HEADLINE = re.compile(r"^rank \d+ of \d+ (failed|died|hung|aborted): ")


class _Recorder:
    """Registered as a plugin object: combines each test's setup / call / teardown reports into
    one line of the results file."""

    def __init__(self, path: str) -> None:
        self.path = path  # the JSON-lines file the CLI reads
        self.pending: dict[str, dict[str, Any]] = {}  # nodeid -> result so far (until teardown)
        self.collected_seen = False  # under xdist every worker announces its collection

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as stream:
            stream.write(json.dumps(record) + "\n")

    def _collected(self, count: int) -> None:
        if not self.collected_seen:
            self.collected_seen = True
            self.write({"event": "collected", "count": count})

    # ------------------------------------------------------------------ hooks
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if not session.config.pluginmanager.has_plugin("dsession"):  # xdist reports below
            self._collected(len(session.items))

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        self._collected(len(ids))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.write(
                {
                    "event": "collect_error",
                    "nodeid": report.nodeid,
                    "detail": failure_message(report),
                }
            )

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        result = self.pending.setdefault(
            report.nodeid,
            {
                "event": "test",
                "nodeid": report.nodeid,
                "outcome": "pass",
                "detail": "",
                "duration": 0.0,
            },
        )
        result["duration"] += getattr(report, "duration", 0.0) or 0.0
        outcome, detail = _classify(report)
        if outcome is not None and _RANK[outcome] > _RANK[result["outcome"]]:
            result["outcome"], result["detail"] = outcome, detail
        recorded = dict(report.user_properties)
        if checks.PROPERTY_VERDICT in recorded:  # the last phase that says wins (teardown)
            result["check_id"] = recorded.get(checks.PROPERTY_CHECK, "")
            result["verdict"] = recorded[checks.PROPERTY_VERDICT]
            result["reason"] = recorded.get(checks.PROPERTY_REASON, "")
        if report.when == "teardown":
            self.write(self.pending.pop(report.nodeid))


# Which outcome wins when phases disagree (a failing teardown after a pass is a failure)
_RANK = {"pass": 0, "xpass": 1, "skip": 2, "xfail": 3, "fail": 4}


def _classify(report: pytest.TestReport) -> tuple[str | None, str]:
    """This phase's contribution: (outcome or None when it says nothing, detail)."""
    wasxfail = getattr(report, "wasxfail", None)
    if report.failed:
        prefix = "" if report.when == "call" else f"error in {report.when}: "
        return "fail", prefix + failure_message(report)
    if report.skipped:
        if wasxfail is not None:
            return "xfail", _xfail_reason(wasxfail)
        return "skip", _skip_reason(report)
    if report.when == "call":
        if wasxfail is not None:
            return "xpass", _xfail_reason(wasxfail)
        return "pass", ""
    return None, ""


def failure_message(report: Any) -> str:
    """The first assertion (or exception) message of a failed report, on one line.

    pytest marks the message lines of a failure with ``E``; the first exception line wins
    ("SomeError: message", with the line after it when it ends in ":", as "N problems:"
    headlines do), else the first message line, else the crash line.
    """
    text = getattr(report, "longreprtext", "") or str(report.longrepr or "")
    crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "") or ""
    lines = [
        _strip(match.group(1)) for line in text.splitlines() if (match := _ERROR_LINE.match(line))
    ]
    lines = [line for line in lines if line] + [_strip(line) for line in crash.splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return "failed (no message)"
    # the exception's own message first (pytest shows the failing source line before it)
    position = next((i for i, line in enumerate(lines) if _EXCEPTION_LINE.match(line)), 0)
    line = lines[position]
    follows = lines[position + 1] if position + 1 < len(lines) else ""
    return f"{line} {follows}" if line.endswith(":") and follows else line


def _strip(line: str) -> str:
    """Without pytest's "Failed: " and the harness's "rank r of n failed: " prefixes."""
    line = line.strip().removeprefix("Failed: ")
    return _RANK_HEADLINE.sub("", line).strip()


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr or "skipped").splitlines()[-1].removeprefix("Skipped: ")


def _xfail_reason(wasxfail: str) -> str:
    return str(wasxfail).removeprefix("reason: ")


# -----------------------------------------------------------------------------
# Hook


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get(ENV_RESULTS)
    if path and not hasattr(config, "workerinput"):  # the controller (or the only process)
        config.pluginmanager.register(_Recorder(path), "fsdp-conformance-cli-recorder")
