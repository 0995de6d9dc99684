"""``fsdp-conformance run``: the suite in a pytest subprocess (with the records plugin
``cli.records``), its progress from the records, and the matrix (``cli.report``)."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import pathlib
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from fsdp_conformance import checks, constants
from fsdp_conformance.cli import limits, records, report, torchrun
from fsdp_conformance.cli.report import split_nodeid
from fsdp_conformance.cli.usage import (
    DEFAULT_COVERAGE,
    DEFAULT_WORKERS,
    PROG,
    UsageError,
    _add_common,
    _subcommand,
    adapter_name,
    cache_dir,
    check_impl,
    check_keyword_expression,
    check_output,
    check_worker_count,
    check_world_size,
    keep_log,
)
from fsdp_conformance.harness import signals


def _run_command(args: argparse.Namespace) -> int:
    if (targets := _selected_targets(args)) == []:
        print(f"{PROG} run: nothing failed or deviated in the last run; nothing to re-run")
        return 0
    if args.workers is None:  # a few cells: xdist workers would each collect them again
        args.workers = DEFAULT_WORKERS if targets is None else 0
    if (launcher_problem := torchrun.check(args, DEFAULT_WORKERS, "process")) is not None:
        raise UsageError(launcher_problem)
    if uses_torchrun := torchrun.uses_torchrun(args):
        args.workers = 0  # one pytest session per torchrun process
    check_impl(args.impl)
    check_world_size(args.world_size)
    check_keyword_expression(args.k)
    check_worker_count(args.workers)
    try:
        if args.workers != DEFAULT_WORKERS:  # (the default is not the user's request)
            limits.check_workers(args.workers, args.world_size)
    except ValueError as error:
        raise UsageError(str(error)) from None
    for path, option in ((args.report, "--report"), (args.json, "--json"), (args.junit, "--junit")):
        check_output(path, option)
    if args.workers > 0 and importlib.util.find_spec("xdist") is None:
        raise UsageError("-n needs pytest-xdist, which is not installed (or give -n 0)")

    workdir = tempfile.mkdtemp(prefix="run-")  # in the command's private temp directory
    results = os.path.join(workdir, "results.jsonl")
    log_path = os.path.join(workdir, "pytest.log")
    command = pytest_command(args, targets)
    if uses_torchrun:
        command = torchrun.torchrun_command(args, command)
        print(f"{PROG} run: {shlex.join(command)}", file=sys.stderr)
    env = records.suite_environment(results)
    env[constants.ENV_CLI_RERUN] = checks.shell_line(args.impl, _rerun_words(args))
    print(
        f"{PROG} run: suite on {args.impl!r} (coverage {args.coverage}, mode {args.mode}, "
        f"{args.workers or 'no'} xdist workers{', -k ' + repr(args.k) if args.k else ''})",
        file=sys.stderr,
    )
    started = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        # its own session: a signal reaches it only from us (one SIGTERM, then its group killed)
        child = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            progress = _Progress(sys.stderr)
            while child.poll() is None:
                progress.update(report.read_records(results), time.monotonic() - started)
                time.sleep(0.5)
            progress.update(report.read_records(results), time.monotonic() - started)
            progress.finish()
        except KeyboardInterrupt as interrupt:
            code = signals.stop_child(child, interrupt)
            print(
                f"\n{PROG} run: interrupted; pytest output: {keep_log(log_path, 'run')}",
                file=sys.stderr,
            )
            return code
    wall = time.monotonic() - started
    written = report.read_records(results)
    if uses_torchrun and not written:
        return torchrun.no_results_here(child.returncode, keep_log(log_path, "run"))
    cells = report.cells_from_records(written)
    collected = next((r["count"] for r in written if r.get("event") == "collected"), None)
    if (returncode := child.returncode) == 4 or (returncode == 5 and not cells):
        if returncode == 5:
            message = f"-k {args.k!r}: no check matches" if args.k else "no check collected"
        else:
            refusal = next((r["detail"] for r in written if r["event"] == "usage_error"), None)
            message = f"pytest refused the arguments: {refusal or keep_log(log_path, 'run')}"
        raise UsageError(message)

    summary = report.summary_line(cells, adapter_name(args.impl), wall)
    not_run = (collected or 0) - sum(1 for c in cells if not c.check.startswith("collecting "))
    if not_run > 0:
        summary += f"; {not_run} collected cells did not report (see the pytest output)"
    print(f"{report.render_text(cells)}\n\n{summary}")
    if _remember_failures(args, cells):
        line = checks.shell_line(args.impl, [*_rerun_words(args), "--failed"])
        print(f"re-run the failing and deviating cells: {line}", file=sys.stderr)
    _write_outputs(args, cells, _report_header(args, command, wall), summary, returncode)
    if any(cell.outcome == "fail" for cell in cells) or returncode != 0 or not_run > 0:
        if returncode not in (0, 1):
            print(_tail(log_path, 15), file=sys.stderr)
        print(f"pytest output (tracebacks): {keep_log(log_path, 'run')}", file=sys.stderr)
        return 1
    return 0


def pytest_command(args: argparse.Namespace, targets: list[str] | None = None) -> list[str]:
    """The pytest command line ``run`` starts (in the user's directory) on the whole suite or
    on ``targets`` (``--pyargs`` node ids)."""
    command = records.suite_command(
        args.impl,
        f"--fsdp-world-size={args.world_size}",
        f"--fsdp-mode={args.mode}",
        f"--fsdp-coverage={args.coverage}",
        f"--fsdp-timeout={args.timeout:g}",
        targets=targets or (records.SUITE,),
    )
    if args.workers > 0:
        command += ["-n", str(args.workers)]
    if args.k:
        command += ["-k", args.k]
    if args.junit:
        command += [f"--junitxml={os.path.abspath(args.junit)}"]
    return command


def _rerun_words(args: argparse.Namespace) -> list[str]:
    """``fsdp-conformance run`` with the options that decide which cells exist and how they run."""
    words = [PROG, "run", "--impl", args.impl]
    if args.coverage != DEFAULT_COVERAGE:
        words += ["--coverage", args.coverage]
    if args.world_size != 2:
        words += ["--world-size", str(args.world_size)]
    return words + (["--mode", args.mode] if args.mode != "process" else [])


def _suite_classes() -> dict[str, str]:
    """Each test class of the suite -> the module defining it (read from the source files:
    importing them would import torch)."""
    root = pathlib.Path(importlib.util.find_spec(records.SUITE).origin or "").parent
    classes = {}
    for path in root.rglob("test_*.py"):
        module = ".".join((records.SUITE, *path.relative_to(root).with_suffix("").parts))
        source = path.read_text(encoding="utf-8")
        classes.update(dict.fromkeys(re.findall(r"^class (Test\w+)", source, re.MULTILINE), module))
    return classes


def _selected_targets(args: argparse.Namespace) -> list[str] | None:
    """The ``--pyargs`` node ids of ``--cell`` and ``--failed`` (None: the whole suite)."""
    if not args.cell and not args.failed:
        return None
    cells = list(args.cell or [])
    if args.failed:
        if not (path := _failures_file(args)).exists():
            raise UsageError(
                f"--failed: no earlier run of --impl {args.impl} (coverage {args.coverage}, world "
                f"size {args.world_size}) is recorded; run it once without --failed"
            )
        cells += json.loads(path.read_text(encoding="utf-8"))["cells"]
    classes = _suite_classes()
    targets = []
    for cell in dict.fromkeys(cells):
        test_class, _, test = cell.partition("::")
        if test_class not in classes or not test:
            raise UsageError(
                f"--cell {cell!r}: not a cell of the suite; give the id its re-run line names, "
                "CLASS::TEST[CONFIGURATION], e.g. 'TestDDPParity::test_matches_ddp[nested-ws1]'"
            )
        targets.append(f"{classes[test_class]}::{cell}")
    return targets


def _failures_file(args: argparse.Namespace) -> pathlib.Path:
    """Where ``run`` keeps the failing and deviating cells of its last run for ``--failed``: per
    adapter, coverage and world size (and directory, for a ``pkg.mod:ATTR`` adapter)."""
    here = os.getcwd() if ":" in args.impl else ""
    key = "\0".join([args.impl, args.coverage, str(args.world_size), here]).encode()
    return pathlib.Path(cache_dir("failed", f"{hashlib.sha256(key).hexdigest()[:16]}.json"))


def _remember_failures(args: argparse.Namespace, cells: list[Any]) -> bool:
    """Record the failing and deviating cells for ``--failed`` (a cell this run ran is forgotten
    unless it failed or deviated again); whether any is recorded."""
    path = _failures_file(args)
    earlier = json.loads(path.read_text(encoding="utf-8"))["cells"] if path.exists() else []
    ran = {cell.nodeid.partition("::")[2]: cell.outcome for cell in cells if "::" in cell.nodeid}
    kept = {cell for cell in earlier if cell not in ran}
    kept |= {cell for cell, outcome in ran.items() if outcome in ("fail", "xfail")}
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"impl": args.impl, "directory": os.getcwd(), "cells": sorted(kept)}
    path.write_text(json.dumps(document, indent=1), encoding="utf-8")
    return bool(kept)


def _write_outputs(
    args: argparse.Namespace, cells: list[Any], header: dict[str, str], summary: str, code: int
) -> None:
    """--report (Markdown) and --json (pytest writes --junit itself)."""
    if args.report:
        with open(args.report, "w", encoding="utf-8") as stream:
            stream.write(report.render_markdown(cells, header, summary))
    if args.json:
        document = {**header, "summary_line": summary, "pytest_exit_code": code}
        with open(args.json, "w", encoding="utf-8") as stream:
            stream.write(report.render_json(cells, document))


class _Progress:
    """One status line while pytest runs (rewritten in place on a terminal), failures as they
    arrive (their messages are in the matrix at the end)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.seen = 0  # records already handled
        self.total: int | None = None  # cells collected (None: still collecting)
        self.done = 0
        self.tally: dict[str, int] = {}  # outcome -> cells so far
        self.last_line_at = 0.0  # elapsed seconds of the last line printed (not a tty)
        self.width = shutil.get_terminal_size((100, 20)).columns

    def update(self, records: list[dict[str, Any]], elapsed: float) -> None:
        latest = ""
        for record in records[self.seen :]:
            if (event := record.get("event")) == "collected":
                self.total = record["count"]
                self._line(f"collected {self.total} cells (check x configuration)", elapsed)
            elif event in ("test", "collect_error"):
                outcome = record.get("outcome", "fail")
                self.done += event == "test"
                self.tally[outcome] = self.tally.get(outcome, 0) + 1
                latest = "{}[{}]".format(*split_nodeid(record["nodeid"]))
                if outcome == "fail":
                    self._line(f"FAIL {latest}", elapsed)
        self.seen = len(records)
        if self.total is None:
            status = "collecting the suite"
        else:
            tally = " ".join(f"{n} {o}" for o, n in sorted(self.tally.items()))
            status = f"[{self.done}/{self.total}] {tally} {latest}"
        if self.tty:
            line = f"{_clock(elapsed)} {status}"[: self.width - 1]
            self.stream.write("\r" + line.ljust(self.width - 1))
            self.stream.flush()
        elif latest and elapsed - self.last_line_at >= 15:
            self._line(status, elapsed)

    def _line(self, text: str, elapsed: float) -> None:
        self.finish()
        self.stream.write(f"{_clock(elapsed)} {text}\n")
        self.stream.flush()
        self.last_line_at = elapsed

    def finish(self) -> None:  # clears the status line
        if self.tty:
            self.stream.write("\r" + " " * (self.width - 1) + "\r")
            self.stream.flush()


def _clock(seconds: float) -> str:
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes:2d}:{rest:02d}"


def _tail(path: str, lines: int) -> str:
    with open(path, encoding="utf-8", errors="replace") as stream:
        return "".join(stream.readlines()[-lines:]).rstrip()


def _report_header(args: argparse.Namespace, command: list[str], wall: float) -> dict[str, str]:
    return {
        "impl": args.impl,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} "
        f"{platform.release()}, load average {os.getloadavg()[0]:.1f}",
        "versions": f"python {platform.python_version()}, torch "
        f"{report.package_version('torch')}, fsdp-conformance "
        f"{report.package_version('fsdp-conformance')}",
        "options": f"world size {args.world_size}, mode {args.mode}, coverage {args.coverage}, "
        f"{args.workers} xdist workers" + (f", -k {args.k!r}" if args.k else ""),
        "pytest command": shlex.join(["python", *command[1:]]),
        "wall time": f"{wall:.0f} s",
    }


def add_parser(commands: Any) -> None:
    run = _subcommand(
        commands,
        "run",
        "run the conformance suite and print the check x configuration matrix",
        "Run the conformance suite (pytest --pyargs fsdp_conformance.suite) against one FSDP "
        "implementation and print the matrix: each check in each configuration -> pass / FAIL "
        "(first assertion message) / xfail / skip (reason). The default (pairwise coverage, 2 "
        "xdist workers) fits in 10 minutes on a 2-core CPU host.",
        "fsdp-conformance run",
        "fsdp-conformance run --impl torch-fsdp1 --report matrix.md --json matrix.json",
        "fsdp-conformance run --impl mypkg.fsdp_adapter:ADAPTER -k 'MemoryBound or Parity'",
        "fsdp-conformance run -n 0 -k test_counts_per_phase --junit junit.xml",
        "fsdp-conformance run --impl torch-fsdp1 --failed",
    )
    _add_common(
        run,
        "ranks for checks that do not fix their own world size (default 2; most checks fix it, "
        "the parity checks also run at 1 and 4)",
    )
    modes = "how ranks run: reused processes (default), a fresh set per check, or threads"
    run.add_argument("--mode", choices=constants.MODES, default="process", help=modes)
    workers = (
        f"pytest-xdist workers (default {DEFAULT_WORKERS}, 0 with --cell or --failed; 0: run in "
        "one process)"
    )
    run.add_argument("-n", dest="workers", type=int, metavar="WORKERS", help=workers)
    pairs = "parity configurations: every pair of settings (default) or the full product"
    run.add_argument(
        "--coverage", choices=constants.COVERAGES, default=DEFAULT_COVERAGE, help=pairs
    )
    run.add_argument("-k", metavar="EXPR", help="only checks matching this pytest -k expression")
    run.add_argument(
        "--cell", action="append", metavar="ID",
        help="only this cell (repeatable): the id a failing cell's re-run line names, "
        "CLASS::TEST[CONFIGURATION] as the matrix shows it",
    )  # fmt: skip
    run.add_argument(
        "--failed", action="store_true",
        help="only the cells that failed or deviated in the last run of this --impl (with the "
        "same --coverage and --world-size)",
    )  # fmt: skip
    run.add_argument("--report", metavar="FILE.md", help="write the matrix as Markdown")
    run.add_argument("--json", metavar="FILE", help="write the matrix as JSON")
    run.add_argument("--junit", metavar="FILE", help="write pytest's JUnit XML")
    torchrun.add_arguments(run)
    run.set_defaults(handler=_run_command)
