"""What the subcommands share: usage errors, argument types, the checks made before anything
starts, and running a measurement in a rank set."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from typing import Any, NoReturn

from fsdp_conformance import constants
from fsdp_conformance.cli import limits
from fsdp_conformance.harness.extras import missing_extra

PROG = "fsdp-conformance"
# `run` defaults: the whole default run fits in 10 minutes on a 2-core CPU host (docs/cli.md)
DEFAULT_COVERAGE = "pairwise"
DEFAULT_WORKERS = 2
CLI_TIMEOUT_S = 300.0  # per-test timeout of `run` and `conformance` (xdist workers share CPUs)
RANKS_PER_CPU = 4  # beyond this a world does not run in reasonable time
KEPT_LOGS = 20  # pytest logs of failed or interrupted `run`s kept in cache_dir("logs")


def cache_dir(*parts: str) -> str:
    """``fsdp-conformance/<parts>`` under ``XDG_CACHE_HOME`` (default ``~/.cache``): what the
    commands keep between runs, never in the working directory or /tmp."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "fsdp-conformance", *parts)


@contextlib.contextmanager
def private_tempdir() -> Iterator[str]:
    """A temp directory for every temp file of this command and its children (``TMPDIR`` and
    ``tempfile.tempdir``), removed however the command ends. The GPU lock files stay in the
    shared temp directory (every process of the user must see them)."""
    import pytest

    from fsdp_conformance.harness import gpus

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(constants.ENV_GPU_LOCK_DIR, gpus.lock_dir_path())  # before TMPDIR changes
        path = tempfile.mkdtemp(prefix="fsdp-cli-")
        patch.setenv("TMPDIR", path)
        patch.setattr(tempfile, "tempdir", path)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


def keep_log(path: str, command: str) -> str:
    """Move the log ``path`` into ``cache_dir("logs")`` (the newest ``KEPT_LOGS`` stay); its new
    path."""
    directory = cache_dir("logs")
    os.makedirs(directory, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    kept = os.path.join(directory, f"{command}-{stamp}-{os.getpid()}.log")
    shutil.move(path, kept)
    for old in sorted(pathlib.Path(directory).iterdir(), key=os.path.getmtime)[:-KEPT_LOGS]:
        with contextlib.suppress(OSError):
            os.remove(old)
    return kept


# Each command's exit codes: shown under its --help, documented in docs/cli.md (a test compares)
_EXIT_0_AND_1 = {
    "run": (
        "nothing failed (skips and expected failures allowed)",
        "a check failed, pytest could not finish, or the --impl module raises on import",
    ),
    "overlap": (
        "the measurement ran (its verdict line carries the suite's judgement)",
        "it cannot run on this adapter, or its ranks failed",
    ),
    "timeline": (
        "the picture was drawn (its verdict says within or over the bound)",
        "it cannot run on this adapter, or its ranks failed",
    ),
    "conformance": ("the table was written", "an --impl module raises on import"),
    "fuzz": (
        "no counterexample found",
        "a counterexample (repro.py written), no case could run, or the ranks failed",
    ),
    "coverage": ("the report was printed", "the suite could not be collected for this adapter"),
}
EXIT_CODES: dict[str, dict[int, str]] = {
    command: {
        0: success,
        1: failure,
        2: "a bad argument, one line on stderr (also an --impl that does not resolve, or a "
        "built-in adapter whose extra is not installed)",
        130: "SIGINT (Ctrl-C)",
        143: "SIGTERM",
    }
    for command, (success, failure) in _EXIT_0_AND_1.items()
}


def exit_codes_epilog(command: str) -> str:
    """The "exit codes:" lines of ``command``'s --help."""
    lines = [f"  {code}  {text}" for code, text in sorted(EXIT_CODES[command].items())]
    return "exit codes:\n" + "\n".join(lines)


class BrokenAdapter(Exception):
    """The adapter's module raises when imported: exit code 1, with its traceback."""


class UsageError(Exception):
    """A bad argument: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def _bool(text: str) -> bool:
    if (value := text.strip().lower()) in ("true", "1", "yes", "on"):
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


def check_impl(name: str) -> None:
    """Resolve ``name`` as the ranks will (``pkg.mod:ATTR`` with the current directory on
    ``sys.path``; of a built-in only its extra is checked); UsageError with the reason if it
    does not resolve, BrokenAdapter when its module raises."""
    if name in constants.BUILTIN_ADAPTERS:
        if (problem := missing_extra(name)) is not None:
            raise UsageError(f"--impl {name}: {problem}")
        return
    if ":" not in name:
        raise UsageError(
            f"unknown --impl {name!r}: use one of {', '.join(constants.BUILTIN_ADAPTERS)} or "
            "'pkg.module:ATTR' naming an Adapter instance, subclass or factory"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module = name.partition(":")[0]
    missing = _missing_module(module) if module else "nothing before the ':'"
    if missing is not None:  # said before get_adapter imports torch
        raise UsageError(
            f"--impl {name}: cannot import module {module!r} ({missing}); install its package, "
            "or run from its folder (or add that to PYTHONPATH)"
        )
    from fsdp_conformance.adapters import get_adapter
    from fsdp_conformance.adapters.registry import AdapterImportError

    try:
        get_adapter(name)
    except AdapterImportError as error:  # the module exists but fails
        raise BrokenAdapter(error) from error
    except Exception as error:  # noqa: BLE001  any failure to load the user's module is a usage error
        message = " ".join(str(error).split())
        if not isinstance(error, ValueError):
            message = f"cannot load adapter {name!r}: {type(error).__name__}: {message}"
        raise UsageError(f"--impl {message}") from None


def _missing_module(module: str) -> str | None:
    """Why ``module`` cannot be found (``find_spec``: imports only its parent packages), or
    None when it is there or the question is for ``get_adapter`` (a broken parent package)."""
    try:
        return None if importlib.util.find_spec(module) else f"No module named {module!r}"
    except ModuleNotFoundError as error:
        name = error.name or ""
        return str(error) if name and f"{module}.".startswith(f"{name}.") else None
    except Exception:  # noqa: BLE001  get_adapter reports it, with its traceback
        return None


def adapter_name(impl: str) -> str:
    """The adapter's own name (``impl`` for a built-in)."""
    if impl in constants.BUILTIN_ADAPTERS:
        return impl
    from fsdp_conformance.adapters import get_adapter

    return get_adapter(impl).name


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


def check_world_size(world_size: int, minimum: int = 1) -> None:
    """UsageError unless ``minimum`` <= ``world_size`` <= the most CPU ranks this machine runs
    (cores x RANKS_PER_CPU, memory)."""
    check_at_least(world_size, "--world-size", minimum)
    cpus = os.cpu_count() or 1
    caps = [(cpus * RANKS_PER_CPU, f"{cpus} CPUs x {RANKS_PER_CPU} ranks each")]
    if (available := limits.available_memory()) is not None:
        why = f"{available / 1024**3:.1f} GiB available memory / {limits.RANK_BYTES // 1024**2} MiB"
        caps.append((max(1, available // limits.RANK_BYTES), why + " per rank"))
    limit, why = min(caps)
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
        open(path, "a", encoding="utf-8").close()
    except OSError as error:
        raise UsageError(f"{option} {path}: cannot write there ({error.strerror})") from None
    if not existed:
        os.remove(path)


def measure_in_ranks(
    command: str,
    kwargs: dict[str, Any],
    args: argparse.Namespace,
    backend: str | None,
    gpus: int = 0,
) -> dict[str, Any] | None:
    """The JSON document rank 0 wrote from ``cli.ranks.<command>_in_rank(dist, out_file,
    **kwargs)`` in every rank (on ``backend``, None: chosen; needing ``gpus``); None (the reason
    on stderr) when the ranks skipped or failed."""
    from fsdp_conformance.harness.controller import run_function

    function = f"{command}_in_rank"
    with tempfile.TemporaryDirectory(prefix="fsdp-cli-") as workdir:
        out_file = os.path.join(workdir, f"{command}.json")
        result = run_function(
            "fsdp_conformance.cli.ranks",
            function,
            {"out_file": out_file, **kwargs},
            world_size=args.world_size,
            timeout=args.timeout,
            impl=args.impl,
            test_id=f"{PROG} {function}",
            backend=backend,
            gpus=gpus,
        )
        status, message = ranks_verdict(result)
        if status == "passed":
            with open(out_file, encoding="utf-8") as stream:
                return json.load(stream)
    if status == "skipped":
        print(f"{PROG} {command}: cannot run on this adapter: {message}", file=sys.stderr)
    else:
        print(f"{PROG} {command}: the ranks failed:\n{message}", file=sys.stderr)
    return None


def ranks_verdict(result: Any) -> tuple[str, str]:
    """A rank set's (status, message); a failure's message ends with the ranks' output."""
    status, message, output = result.verdict.status, result.verdict.message, result.output()
    return status, message + ("\n" + output if status == "failed" and output else "")


def write_json(path: str, document: Any, indent: int) -> None:
    with open(path, "w", encoding="utf-8") as stream:
        json.dump(document, stream, indent=indent)


def check_at_least(value: int, option: str, minimum: int = 1, why: str = "") -> None:
    """UsageError unless ``value`` of ``option`` is at least ``minimum``."""
    if value < minimum:
        raise UsageError(f"{option} {value}: {why or f'must be >= {minimum}'}")


def check_worker_count(workers: int) -> None:
    if workers < 0:
        raise UsageError(f"-n {workers}: give 0 (no xdist) or a number of workers")


def _add_common(parser: argparse.ArgumentParser, world_size_help: str) -> None:
    _add_impl(parser)
    parser.add_argument("--world-size", type=int, default=2, metavar="N", help=world_size_help)
    _add_timeout(parser)


def _add_impl(parser: argparse.ArgumentParser) -> None:
    what = (
        "FSDP under test: impl (the reference FSDP, default), torch-fsdp1, torch-fsdp2, "
        "fairscale, deepspeed or pkg.module:ATTR (an Adapter instance, subclass or factory; the "
        "current directory and PYTHONPATH are searched)"
    )
    parser.add_argument("--impl", default="impl", metavar="NAME", help=what)


def _add_timeout(parser: argparse.ArgumentParser) -> None:
    why = f"fail a rank body still running after this long (default {CLI_TIMEOUT_S:g})"
    parser.add_argument(
        "--timeout", type=_positive_float, default=CLI_TIMEOUT_S, metavar="SECONDS", help=why
    )


def _subcommand(
    commands: Any, name: str, summary: str, description: str, *examples: str
) -> argparse.ArgumentParser:
    """Add subcommand ``name``: its description filled to 79 columns (the raw formatter keeps
    the examples' layout), ``examples`` under it."""
    return commands.add_parser(
        name,
        help=summary,
        description=textwrap.fill(description, width=79),
        epilog="examples:\n" + "\n".join(f"  {example}" for example in examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
