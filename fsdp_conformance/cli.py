"""``fsdp-conformance``: the conformance matrix, the overlap experiment, the memory timeline.

    fsdp-conformance run                                  # the suite on the reference FSDP
    fsdp-conformance run --impl torch-fsdp1 --report matrix.md
    fsdp-conformance run --impl mypkg.fsdp_adapter:ADAPTER -k parity
    fsdp-conformance overlap --limit-all-gathers false
    fsdp-conformance timeline --lag strict --out timeline.png --data timeline.json

``run`` starts pytest on ``fsdp_conformance.suite`` in a subprocess (``--pyargs``, with
pytest-xdist when ``-n`` > 0) with the collector plugin ``fsdp_conformance._cli_collect``, shows
progress from its results file, and prints the matrix (``fsdp_conformance._cli_report``).
``overlap`` and ``timeline`` run the suite's measuring functions in a rank set of
``fsdp_conformance.world`` (``fsdp_conformance._cli_ranks``); ``timeline`` draws with
matplotlib (``fsdp_conformance._timeline``).

Exit codes: 0 success (``run``: nothing failed); 1 a check failed or the experiment could not
run; 2 a bad argument (one line on stderr, never a traceback); 130 interrupted.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from fsdp_conformance import _limits, _signals

PROG = "fsdp-conformance"
BUILTIN_IMPLS = ("impl", "torch-fsdp1", "torch-fsdp2")
MODES = ("process", "process-fresh", "thread")
COVERAGES = ("pairwise", "full")
# `run` defaults, chosen so that the whole default run fits in 10 minutes on a 2-core CPU host
# (measured in docs/cli.md): pairwise coverage of the parity configs, two xdist workers
DEFAULT_COVERAGE = "pairwise"
DEFAULT_WORKERS = 2
# Per-test timeout in the ranks (seconds; the suite's own default is 120)
DEFAULT_TIMEOUT = 300.0
# Memory one CPU rank process needs (torch + gloo + a small model), for the world-size limit
RANK_MEMORY_BYTES = 512 * 1024**2
# CPU ranks per core beyond which a world is not runnable in reasonable time
RANKS_PER_CPU = 4


class BrokenAdapter(Exception):
    """The adapter's module exists but raises when imported: exit code 1 (a broken adapter,
    not a usage error), with its traceback."""


class UsageError(Exception):
    """A bad argument: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


# -----------------------------------------------------------------------------
# Validation (before anything starts)


def check_impl(name: str) -> None:
    """Resolve ``name`` as the ranks will (``get_adapter``); UsageError with the reason if not.

    Built-in names are not imported here (they always resolve). ``pkg.mod:ATTR`` is imported
    with the current directory on ``sys.path``, as ``python -m pytest`` and the ranks have it.
    """
    if name in BUILTIN_IMPLS:
        return
    if ":" not in name:
        raise UsageError(
            f"unknown --impl {name!r}: use one of {', '.join(BUILTIN_IMPLS)} or "
            "'pkg.module:ATTR' naming an Adapter instance, subclass or factory"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from fsdp_conformance.adapters import get_adapter
    from fsdp_conformance.adapters.registry import AdapterImportError

    try:
        get_adapter(name)
    except AdapterImportError as error:
        # the module exists but fails: the adapter is broken (exit 1 with its traceback)
        raise BrokenAdapter(error) from error
    except Exception as error:  # noqa: BLE001  any failure to load the user's module is a usage error
        message = " ".join(str(error).split())
        if not isinstance(error, ValueError):
            message = f"cannot load adapter {name!r}: {type(error).__name__}: {message}"
        raise UsageError(f"--impl {message}") from None


def check_keyword_expression(expression: str | None) -> None:
    """UsageError unless pytest can parse ``-k expression`` (pytest-xdist would crash on it)."""
    if not expression:
        return
    try:
        from _pytest.mark.expression import Expression
    except ImportError:  # another pytest layout: pytest itself reports it
        return
    try:
        Expression.compile(expression)
    except Exception as error:  # noqa: BLE001  ParseError (pytest 8) or SyntaxError (pytest 9)
        reason = getattr(error, "msg", None) or str(error)
        raise UsageError(f"-k {expression!r}: not a pytest -k expression ({reason})") from None


def _available_memory() -> int | None:
    """Bytes of memory available to new processes (MemAvailable: free + reclaimable cache)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # sysconf names missing on this platform
        return None


def max_world_size() -> tuple[int, str]:
    """The most CPU ranks this machine runs, and why (cores x RANKS_PER_CPU, memory)."""
    cpus = os.cpu_count() or 1
    limits = [(cpus * RANKS_PER_CPU, f"{cpus} CPUs x {RANKS_PER_CPU} ranks each")]
    available = _available_memory()
    if available is not None:
        limits.append(
            (
                max(1, available // RANK_MEMORY_BYTES),
                (
                    f"{available / 1024**3:.1f} GiB available memory / "
                    f"{RANK_MEMORY_BYTES // 1024**2} MiB per rank"
                ),
            )
        )
    return min(limits)


def check_world_size(world_size: int, minimum: int = 1) -> None:
    if world_size < minimum:
        raise UsageError(f"--world-size {world_size}: must be >= {minimum}")
    limit, why = max_world_size()
    if world_size > limit:
        raise UsageError(
            f"--world-size {world_size}: this machine can run at most {limit} ranks ({why})"
        )


def check_output(path: str | None, option: str) -> None:
    """UsageError unless ``path`` can be written (tried for real; a new file is removed)."""
    if path is None:
        return
    if os.path.isdir(path):
        raise UsageError(f"{option} {path}: is a directory; give a file name")
    existed = os.path.exists(path)
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as error:
        raise UsageError(f"{option} {path}: cannot write there ({error.strerror})") from None
    if not existed:
        os.remove(path)


# -----------------------------------------------------------------------------
# run


def _run_command(args: argparse.Namespace) -> int:
    from fsdp_conformance import _cli_collect, _cli_report

    check_impl(args.impl)
    check_world_size(args.world_size)
    check_keyword_expression(args.k)
    if args.workers < 0:
        raise UsageError(f"-n {args.workers}: give 0 (no xdist) or a number of workers")
    try:
        if args.workers != DEFAULT_WORKERS:  # (the default is not the user's request)
            _limits.check_workers(args.workers, args.world_size)
    except ValueError as error:
        raise UsageError(str(error)) from None
    for path, option in ((args.report, "--report"), (args.json, "--json"), (args.junit, "--junit")):
        check_output(path, option)
    if args.workers > 0 and importlib.util.find_spec("xdist") is None:
        raise UsageError("-n needs pytest-xdist, which is not installed (or give -n 0)")

    workdir = tempfile.mkdtemp(prefix="fsdp-cli-")
    results = os.path.join(workdir, "results.jsonl")
    log_path = os.path.join(workdir, "pytest.log")
    command = pytest_command(args)
    # a fresh pytest session: not a worker of an outer pytest-xdist run (the CLI's own tests)
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_TEST"))
    }
    env[_cli_collect.ENV_RESULTS] = results
    print(
        f"{PROG} run: suite on {args.impl!r} (coverage {args.coverage}, mode {args.mode}, "
        f"{args.workers or 'no'} xdist workers{', -k ' + repr(args.k) if args.k else ''})",
        file=sys.stderr,
    )
    started = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log, _signals.sigterm_interrupts():
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            progress = _Progress(sys.stderr)
            while child.poll() is None:
                progress.update(_cli_report.read_records(results), time.monotonic() - started)
                time.sleep(0.5)
            progress.update(_cli_report.read_records(results), time.monotonic() - started)
            progress.finish()
        except KeyboardInterrupt as interrupt:
            code = _signals.stop_child(child, interrupt)
            print(f"\n{PROG} run: interrupted; pytest output: {log_path}", file=sys.stderr)
            return code
    wall = time.monotonic() - started
    records = _cli_report.read_records(results)
    cells = _cli_report.cells_from_records(records)
    collected = next((r["count"] for r in records if r.get("event") == "collected"), None)
    returncode = child.returncode
    if returncode == 4 or (returncode == 5 and not cells):
        if returncode == 5:
            message = f"-k {args.k!r}: no check matches" if args.k else "no check collected"
        else:
            message = f"pytest refused the arguments: {_pytest_error(log_path)}"
        shutil.rmtree(workdir, ignore_errors=True)
        raise UsageError(message)

    summary = _cli_report.summary_line(cells, args.impl, wall)
    not_run = (collected or 0) - sum(1 for c in cells if not c.check.startswith("collecting "))
    if not_run > 0:
        summary += f"; {not_run} collected cells did not report (see the pytest output)"
    print(_cli_report.render_text(cells))
    print()
    print(summary)
    _write_outputs(args, cells, _report_header(args, command, wall), summary, returncode)
    failed = any(cell.outcome == "fail" for cell in cells) or returncode != 0 or not_run > 0
    if failed:
        print(f"pytest output (tracebacks): {log_path}", file=sys.stderr)
        if returncode not in (0, 1):
            print(_tail(log_path, 15), file=sys.stderr)
        return 1
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def pytest_command(args: argparse.Namespace) -> list[str]:
    """The pytest command line ``run`` starts (in the user's directory)."""
    command = [
        sys.executable, "-m", "pytest", "--pyargs", "fsdp_conformance.suite",
        "-p", "fsdp_conformance._cli_collect", "-p", "no:cacheprovider",
        "-o", "addopts=", "-q",
        f"--fsdp-impl={args.impl}", f"--fsdp-world-size={args.world_size}",
        f"--fsdp-mode={args.mode}", f"--fsdp-coverage={args.coverage}",
        f"--fsdp-timeout={args.timeout:g}",
    ]  # fmt: skip
    if args.workers > 0:
        command += ["-n", str(args.workers)]
    if args.k:
        command += ["-k", args.k]
    if args.junit:
        command += [f"--junitxml={os.path.abspath(args.junit)}"]
    return command


def _write_outputs(
    args: argparse.Namespace,
    cells: list[Any],
    header: dict[str, str],
    summary: str,
    returncode: int,
) -> None:
    """--report (Markdown) and --json (pytest writes --junit itself)."""
    from fsdp_conformance import _cli_report

    if args.report:
        with open(args.report, "w", encoding="utf-8") as stream:
            stream.write(_cli_report.render_markdown(cells, header, summary))
    if args.json:
        document = {**header, "summary_line": summary, "pytest_exit_code": returncode}
        with open(args.json, "w", encoding="utf-8") as stream:
            stream.write(_cli_report.render_json(cells, document))


class _Progress:
    """One status line while pytest runs (rewritten in place on a terminal), failures as they
    arrive."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream  # where progress goes (stderr)
        self.tty = stream.isatty()  # rewrite one status line in place
        self.seen = 0  # records already handled
        self.total: int | None = None  # cells collected (None: still collecting)
        self.done = 0  # cells finished
        self.tally: dict[str, int] = {}  # outcome -> cells so far
        self.last_line_at = 0.0  # elapsed seconds of the last line printed (not a tty)
        self.width = shutil.get_terminal_size((100, 20)).columns  # status line width

    def update(self, records: list[dict[str, Any]], elapsed: float) -> None:
        from fsdp_conformance._cli_report import split_nodeid

        latest = ""
        for record in records[self.seen :]:
            if record.get("event") == "collected":
                self.total = record["count"]
                self._line(f"collected {self.total} cells (check x configuration)", elapsed, True)
            elif record.get("event") in ("test", "collect_error"):
                outcome = record.get("outcome", "fail")
                self.done += record.get("event") == "test"
                self.tally[outcome] = self.tally.get(outcome, 0) + 1
                check, configuration = split_nodeid(record["nodeid"])
                latest = f"{check}[{configuration}]"
                if outcome == "fail":
                    self._line(f"FAIL {latest}: {record.get('detail', '')}", elapsed, True)
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
            self._line(status, elapsed, True)

    def _line(self, text: str, elapsed: float, force: bool) -> None:
        if self.tty:
            self.stream.write("\r" + " " * (self.width - 1) + "\r")
        self.stream.write(f"{_clock(elapsed)} {text}\n")
        self.stream.flush()
        self.last_line_at = elapsed

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\r" + " " * (self.width - 1) + "\r")
            self.stream.flush()


def _clock(seconds: float) -> str:
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes:2d}:{rest:02d}"


def _tail(path: str, lines: int) -> str:
    with open(path, encoding="utf-8", errors="replace") as stream:
        return "".join(stream.readlines()[-lines:]).rstrip()


def _pytest_error(log_path: str) -> str:
    with open(log_path, encoding="utf-8", errors="replace") as stream:
        text = stream.read()
    errors = [line.removeprefix("ERROR: ") for line in text.splitlines() if "ERROR" in line]
    return " ".join((errors[0] if errors else text.strip().splitlines()[-1]).split())


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _report_header(args: argparse.Namespace, command: list[str], wall: float) -> dict[str, str]:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {
        "impl": args.impl,
        "date": now,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} "
        f"{platform.release()}, load average {os.getloadavg()[0]:.1f}",
        "versions": f"python {platform.python_version()}, torch {_version('torch')}, "
        f"fsdp-conformance {_version('fsdp-conformance')}",
        "options": f"world size {args.world_size}, mode {args.mode}, coverage {args.coverage}, "
        f"{args.workers} xdist workers" + (f", -k {args.k!r}" if args.k else ""),
        "pytest command": shlex.join(["python", *command[1:]]),
        "wall time": f"{wall:.0f} s",
    }


# -----------------------------------------------------------------------------
# overlap and timeline: the suite's measurements in a rank set


def _run_in_ranks(
    function: str,
    kwargs: dict[str, Any],
    impl: str,
    world_size: int,
    backend: str,
    timeout: float,
) -> tuple[str, str]:
    """Call ``fsdp_conformance._cli_ranks.<function>(dist=..., **kwargs)`` in every rank.

    Returns:
        (status, message): the ranks' combined verdict ("passed", "failed", "skipped") and its
        message (failure report with tracebacks, or the skip reason).
    """
    from fsdp_conformance.world.protocol import TestTarget
    from fsdp_conformance.world.runtime import Runtime, RuntimeOptions, TestRequest

    runtime = Runtime(
        RuntimeOptions(
            mode="process", timeout=timeout, world_size=world_size, impl=impl, backend=backend
        )
    )
    request = TestRequest(
        target=TestTarget("fsdp_conformance._cli_ranks", None, (), function),
        kwargs=kwargs,
        test_id=f"{PROG} {function}",
        world_size=world_size,
        mode="process",
        timeout=timeout,
    )
    try:
        result = runtime.run(request)
    finally:
        runtime.close()
    message = result.verdict.message
    if result.verdict.status == "failed" and result.output():
        message += "\n" + result.output()
    return result.verdict.status, message


def _ranks_failed(command: str, status: str, message: str) -> int:
    if status == "skipped":
        print(f"{PROG} {command}: cannot run on this adapter: {message}", file=sys.stderr)
    else:
        print(f"{PROG} {command}: the ranks failed:\n{message}", file=sys.stderr)
    return 1


def _overlap_command(args: argparse.Namespace) -> int:
    check_impl(args.impl)
    check_world_size(args.world_size)
    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats}: must be >= 1")
    check_output(args.json, "--json")
    if args.device == "cuda":
        from fsdp_conformance.world import gpus

        available = gpus.gpu_count()
        if available < args.world_size:
            raise UsageError(
                f"--device cuda: needs one GPU per rank ({args.world_size}), {available} "
                "available; use --device cpu or a smaller --world-size"
            )
    workdir = tempfile.mkdtemp(prefix="fsdp-cli-")
    out_file = os.path.join(workdir, "overlap.json")
    try:
        status, message = _run_in_ranks(
            "overlap_in_rank",
            {"out_file": out_file, "limit_all_gathers": args.limit_all_gathers,
             "repeats": args.repeats},
            args.impl,
            args.world_size,
            "nccl" if args.device == "cuda" else "gloo",
            args.timeout,
        )  # fmt: skip
        if status != "passed":
            return _ranks_failed("overlap", status, message)
        with open(out_file, encoding="utf-8") as stream:
            document = json.load(stream)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(render_overlap(document))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as stream:
            json.dump(document, stream, indent=2)
    return 0


def render_overlap(document: dict[str, Any]) -> str:
    """The overlap table, the ratio and what it means."""
    times = document["times"]
    cuda = document["device"] == "cuda"
    unit = "device ms" if cuda else "ms"
    config = ", ".join(f"{key}={value}" for key, value in document["config"].items())
    rows = [
        ("nothing (no delays)", times["nothing"]),
        (f"communication only ({document['comm_ms']:g} ms per all-gather)", times["all_gather"]),
        (f"compute only ({document['compute_ms']:g} ms per layer)", times["compute"]),
        ("both", times["both"]),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [
        (
            f"overlap of {document['impl']!r} on {document['device']} (world size "
            f"{document['world_size']}, {document['layers']} layers, {config})"
        ),
        f"forward time, minimum of {document['repeats']} runs, maximum over ranks:",
        "",
        f"  {'case':<{width}}  {unit:>10}",
    ]
    lines += [f"  {name:<{width}}  {value:10.1f}" for name, value in rows]
    lines += [
        "",
        f"all-gathers per forward: {times['all_gathers']} ({times['synchronous']} synchronous)",
    ]
    if cuda:
        lines.append(
            f"overlap ratio (compute + communication) / both = {document['ratio']:.2f} "
            "(> 1.1: overlapped, seed 000's threshold)"
        )
    else:
        serialised = (
            times["all_gathers"] * document["comm_ms"] + times["compute"] - times["nothing"]
        )
        lines.append(
            f"overlap ratio (both - nothing) / (communication + compute serialised) = "
            f"{times['both'] - times['nothing']:.1f} / {serialised:.1f} = {document['ratio']:.2f} "
            f"(1.0: no overlap; <= {document['max_ratio']}: the suite's pass threshold)"
        )
        if times["synchronous"]:
            lines.append(
                "the adapter issues its all-gathers synchronously (async_op=False): the CPU "
                "thread blocks in each, so nothing can overlap on CPU"
            )
    verdict = document["failure"] or "communication overlaps computation"
    lines.append(f"verdict: {verdict}")
    return "\n".join(lines)


def _timeline_command(args: argparse.Namespace) -> int:
    check_impl(args.impl)
    check_world_size(args.world_size, minimum=2)
    if args.iterations < 1:
        raise UsageError(f"--iterations {args.iterations}: must be >= 1")
    if args.layers < 4:
        raise UsageError(
            f"--layers {args.layers}: the bound only shows with >= 4 instances (default 6)"
        )
    for path, option in ((args.out, "--out"), (args.data, "--data"), (args.trace, "--trace")):
        check_output(path, option)
    try:
        import matplotlib  # noqa: F401  (imported again, for drawing, in _timeline)
    except ImportError as error:
        raise UsageError(
            "the timeline picture needs matplotlib, which cannot be imported "
            f"({error}): pip install matplotlib"
        ) from None
    workdir = tempfile.mkdtemp(prefix="fsdp-cli-")
    out_file = os.path.join(workdir, "timeline.json")
    try:
        status, message = _run_in_ranks(
            "timeline_in_rank",
            {
                "out_file": out_file,
                "lag": args.lag,
                "iterations": args.iterations,
                "layers": args.layers,
                "backward_prefetch": args.backward_prefetch,
                "forward_prefetch": args.forward_prefetch,
                "trace_file": os.path.abspath(args.trace) if args.trace else None,
            },
            args.impl,
            args.world_size,
            "gloo",
            args.timeout,
        )
        if status != "passed":
            return _ranks_failed("timeline", status, message)
        with open(out_file, encoding="utf-8") as stream:
            document = json.load(stream)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    from fsdp_conformance import _timeline

    document["axes_drawn"] = _timeline.draw(document, args.out)
    print(render_timeline(document))
    written = [f"{args.out} ({document['axes_drawn']} panels)"]
    if args.data:
        with open(args.data, "w", encoding="utf-8") as stream:
            json.dump(document, stream, indent=1)
        written.append(args.data)
    if args.trace:
        ranges = _count_trace_ranges(args.trace, RATE_LIMITER_RANGE)
        written.append(f"{args.trace} (Chrome trace: {ranges} {RATE_LIMITER_RANGE} ranges)")
    print("wrote " + ", ".join(written))
    return 0


# torch FSDP1's (and the reference implementation's) profiler label of the rate limiter's wait
RATE_LIMITER_RANGE = "FullyShardedDataParallel.rate_limiter"


def _count_trace_ranges(path: str, name: str) -> int:
    with open(path, encoding="utf-8") as stream:
        trace = json.load(stream)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return sum(1 for event in events if event.get("name") == name and event.get("ph") == "X")


def render_timeline(document: dict[str, Any]) -> str:
    """Peak resident non-root buffers per iteration and phase, next to the bound."""
    lines = [
        (
            f"resident unsharded buffers of {document['impl']!r}: {document['layers']} instances "
            f"under a root, {document['lag']} lagging device, world size {document['world_size']}"
        ),
        "",
        "  limit_all_gathers  iteration  phase     peak  bound",
    ]
    for panel in document["panels"]:
        for peak in panel["peaks"]:
            over = "  over the bound" if peak["resident"] > peak["bound"] else ""
            lines.append(
                f"  {panel['limit_all_gathers']!s:<17}  {peak['iteration']:>9}  "
                f"{peak['phase']:<8}  {peak['resident']:>4}  {peak['bound']:>5}{over}"
            )
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# Parser


def _add_common(parser: argparse.ArgumentParser, world_size_help: str) -> None:
    parser.add_argument(
        "--impl",
        default="impl",
        metavar="NAME",
        help="FSDP under test: impl (the reference FSDP, default), torch-fsdp1, torch-fsdp2 or "
        "pkg.module:ATTR (an Adapter instance, subclass or factory; the current directory and "
        "PYTHONPATH are searched)",
    )
    parser.add_argument("--world-size", type=int, default=2, metavar="N", help=world_size_help)
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"fail a rank body still running after this long (default {DEFAULT_TIMEOUT:g})",
    )


def _paragraph(text: str) -> str:
    """A help description filled to 79 columns (the raw formatter keeps the examples' layout)."""
    return textwrap.fill(text, width=79)


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog=PROG,
        description="Conformance suite for Fully Sharded Data Parallel implementations.",
        epilog="examples:\n  fsdp-conformance run\n  fsdp-conformance overlap --help\n"
        "  fsdp-conformance timeline --out timeline.png",
        formatter_class=formatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = commands.add_parser(
        "run",
        help="run the conformance suite and print the check x configuration matrix",
        description=_paragraph(
            "Run the conformance suite (pytest --pyargs fsdp_conformance.suite) against "
            "one FSDP implementation and print the matrix: each check (test class and function) in "
            "each configuration (its parametrisation) -> pass / FAIL (first assertion message) / "
            "xfail / skip (reason). Exit code 0 only when nothing failed. Default: pairwise "
            "coverage of the parity configurations and 2 xdist workers (fits in 10 minutes on a "
            "2-core CPU host); --coverage full runs every combination."
        ),
        epilog="examples:\n"
        "  fsdp-conformance run\n"
        "  fsdp-conformance run --impl torch-fsdp1 --report matrix.md --json matrix.json\n"
        "  fsdp-conformance run --impl mypkg.fsdp_adapter:ADAPTER -k 'MemoryBound or Parity'\n"
        "  fsdp-conformance run -n 0 -k test_counts_per_phase --junit junit.xml",
        formatter_class=formatter,
    )
    _add_common(
        run,
        "ranks for checks that do not fix their own world size (default 2; most checks fix it, "
        "the parity checks also run at 1 and 4)",
    )
    run.add_argument(
        "--mode",
        choices=MODES,
        default="process",
        help="how ranks run: reused processes (default), a fresh set per check, or threads",
    )
    run.add_argument(
        "-n",
        dest="workers",
        type=int,
        default=DEFAULT_WORKERS,
        metavar="WORKERS",
        help=f"pytest-xdist workers (default {DEFAULT_WORKERS}; 0: run in one process)",
    )
    run.add_argument(
        "--coverage",
        choices=COVERAGES,
        default=DEFAULT_COVERAGE,
        help="parity configurations: every pair of settings (default) or the full product",
    )
    run.add_argument("-k", metavar="EXPR", help="only checks matching this pytest -k expression")
    run.add_argument("--report", metavar="FILE.md", help="write the matrix as Markdown")
    run.add_argument("--json", metavar="FILE", help="write the matrix as JSON")
    run.add_argument("--junit", metavar="FILE", help="write pytest's JUnit XML")
    run.set_defaults(handler=_run_command)

    overlap = commands.add_parser(
        "overlap",
        help="time compute only / communication only / both and print the overlap ratio",
        description=_paragraph(
            "Reproduce the overlap-timing experiment of the suite "
            "(fsdp_conformance.suite.overlap, seed 000's test_fsdp_overlap): 4 FSDP layers under a "
            "root; each layer computes for a fixed time, each all-gather is delayed; the forward "
            "is timed with nothing / communication only / compute only / both, each the minimum "
            "of --repeats runs and the maximum over ranks. On CPU the delay is injected into the "
            "all-gather's work handle without blocking the CPU thread, and forward prefetch is on; "
            "on CUDA both delays are torch.cuda._sleep on the device. Prints the table, the "
            "overlap ratio and the suite's verdict; exit code 0 when the measurement ran."
        ),
        epilog="examples:\n"
        "  fsdp-conformance overlap --limit-all-gathers false\n"
        "  fsdp-conformance overlap --impl torch-fsdp1 --limit-all-gathers true\n"
        "  fsdp-conformance overlap --device cuda --json overlap.json",
        formatter_class=formatter,
    )
    _add_common(overlap, "ranks (default 2)")
    overlap.add_argument(
        "--limit-all-gathers",
        type=_bool,
        default=False,
        metavar="true|false",
        help="the rate limiter setting (default false, as in the seed's experiment)",
    )
    overlap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    overlap.add_argument(
        "--repeats", type=int, default=4, metavar="K", help="runs per case, Min-k (default 4)"
    )
    overlap.add_argument("--json", metavar="FILE", help="write the measurement as JSON")
    overlap.set_defaults(handler=_overlap_command)

    timeline = commands.add_parser(
        "timeline",
        help="draw resident unsharded buffers over time with limit_all_gathers on and off",
        description=_paragraph(
            "Train a chain of --layers FSDP instances under a root for a few "
            "iterations under the lagging device (fsdp_conformance.observe: events complete only "
            "when the CPU blocks on them), once with limit_all_gathers=True and once with False, "
            "counting resident unsharded buffers after every event (fsdp_conformance.suite."
            "memory_bound). Draws two panels (forward and backward shaded, the bound as a dashed "
            "line), prints the peaks per phase, and optionally writes the data and a Chrome trace "
            "of the limited run whose FullyShardedDataParallel.rate_limiter ranges show the "
            "limiter's waits. Needs matplotlib."
        ),
        epilog="examples:\n"
        "  fsdp-conformance timeline --out timeline.png\n"
        "  fsdp-conformance timeline --impl torch-fsdp1 --lag drained --data timeline.json\n"
        "  fsdp-conformance timeline --trace trace.json   # open in chrome://tracing or Perfetto",
        formatter_class=formatter,
    )
    _add_common(timeline, "ranks (default 2, at least 2)")
    timeline.add_argument(
        "--lag",
        choices=("strict", "drained"),
        default="strict",
        help="strict: the device never catches up by itself (default); drained: it catches up "
        "at the end of every iteration",
    )
    timeline.add_argument("--out", default="timeline.png", metavar="FILE.png")
    timeline.add_argument("--data", metavar="FILE.json", help="write the plotted data as JSON")
    timeline.add_argument(
        "--trace", metavar="FILE.json", help="write a Chrome trace (torch.profiler) of rank 0"
    )
    timeline.add_argument("--iterations", type=int, default=3, metavar="N")
    timeline.add_argument("--layers", type=int, default=6, metavar="N", help="instances (>= 4)")
    timeline.add_argument(
        "--backward-prefetch",
        type=lambda text: None if text.lower() == "none" else text.upper(),
        choices=("BACKWARD_PRE", "BACKWARD_POST", None),
        default="BACKWARD_PRE",
        metavar="BACKWARD_PRE|BACKWARD_POST|none",
    )
    timeline.add_argument("--forward-prefetch", action="store_true")
    timeline.set_defaults(handler=_timeline_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The console script ``fsdp-conformance``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except UsageError as error:
        sys.stderr.write(f"{PROG} {args.command}: error: {error}\n")
        return 2
    except BrokenAdapter as error:
        sys.stderr.write("".join(traceback.format_exception(error.__cause__ or error)))
        sys.stderr.write(f"{PROG} {args.command}: error: {error} (the adapter is broken)\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write(f"\n{PROG} {args.command}: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
