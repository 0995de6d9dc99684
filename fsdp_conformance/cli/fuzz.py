"""``fsdp-conformance fuzz``: generated models and training programs, FSDP vs DDP (docs/fuzz.md).
The hypothesis run happens in one rank set (``suite.fuzz.driver``); this process echoes rank 0's
progress line, prints the minimal failing case and writes its ``repro.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from typing import Any

from fsdp_conformance.cli import usage

DEFAULT_EXAMPLES = 100
DEFAULT_OUT = "repro.py"
DEFAULT_RUN_TIMEOUT = 3600.0  # the whole run's bound without --timeout
PROGRESS_INTERVAL_S = 0.5  # how often the progress line is refreshed on a terminal
PROGRESS_LINE_S = 10.0  # how often a progress line is printed when stderr is not a terminal


def _fuzz_command(args: argparse.Namespace) -> int:
    usage.check_at_least(args.examples, "--examples")
    usage.check_at_least(args.seed, "--seed", 0)
    for option, value in (("--max-seconds", args.max_seconds), ("--timeout", args.timeout)):
        if value is not None and not value > 0:
            raise usage.UsageError(f"{option} {value:g}: must be > 0")
    usage.check_impl(args.impl)
    usage.check_world_size(args.world_size)
    usage.check_output(args.out, "--out")
    from fsdp_conformance.suite.fuzz.driver import HYPOTHESIS_MISSING, FuzzResult

    try:
        import hypothesis  # noqa: F401
    except ImportError:
        raise usage.UsageError(HYPOTHESIS_MISSING) from None
    if (timeout := args.timeout) is None:
        timeout = DEFAULT_RUN_TIMEOUT if args.max_seconds is None else 2 * args.max_seconds + 300
    with tempfile.TemporaryDirectory(prefix="fsdp-fuzz-", ignore_cleanup_errors=True) as workdir:
        out_file = os.path.join(workdir, "result.json")
        progress_file = os.path.join(workdir, "progress.txt")
        kwargs = {name: getattr(args, name) for name in ("examples", "seed", "max_seconds")}
        kwargs.update(out_file=out_file, progress_file=progress_file)
        status, message = _run_with_progress(kwargs, args, timeout, progress_file)
        if status != "passed":
            print(f"{usage.PROG} fuzz: the ranks {status}:\n{message}", file=sys.stderr)
            return 1
        with open(out_file, encoding="utf-8") as stream:
            result = FuzzResult.from_json(stream.read())
    return _report(result, args)


def _report(result: Any, args: argparse.Namespace) -> int:
    command = f"{usage.PROG} fuzz --impl {args.impl} --seed {args.seed}"
    print(f"{command} --world-size {args.world_size}: {result.summary()}")
    for text, count in result.refusal_reasons:
        print(f"  refused {count}x: {text}")
    for reason in result.deviation_reasons:
        print(f"  declared deviation seen: {reason}")
    if result.status == "pass":
        print("no counterexample found")
        return 0
    if result.status == "unsatisfiable":
        print(f"no generated case could run: {result.message}")
        return 1
    from fsdp_conformance.suite.fuzz.repro import write_repro
    from fsdp_conformance.suite.fuzz.spec import Block, FuzzCase, ModelSpec, Program, Seq, Step

    names = {cls.__name__: cls for cls in (Block, FuzzCase, ModelSpec, Program, Seq, Step)}
    case = eval(result.case, {"__builtins__": {}}, names)  # our own repr of a FuzzCase
    stopped = " (shrinking stopped by --max-seconds)" if result.time_limited else ""
    shrunk = f"shrunk in {result.shrinks} runs{stopped}"
    print(f"COUNTEREXAMPLE after {result.found_at} examples, {shrunk}:")
    print(result.description)
    print(f"first difference: {result.message}")
    write_repro(args.out, case, args.impl, args.world_size, args.seed, result.message)
    print(f"wrote {args.out}: python {args.out} (exit 1 while the failure persists)")
    return 1


def _run_with_progress(
    kwargs: dict[str, Any], args: argparse.Namespace, timeout: float, progress_file: str
) -> tuple[str, str]:
    """Run ``fuzz_in_rank`` in a rank set, echoing rank 0's progress line."""
    from fsdp_conformance.harness.controller import function_request

    runtime, request = function_request(
        "fsdp_conformance.suite.fuzz.driver",
        "fuzz_in_rank",
        kwargs,
        world_size=args.world_size,
        timeout=timeout,
        impl=args.impl,
        test_id=f"{usage.PROG} fuzz",
    )
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = runtime.run(request)
        except BaseException as error:  # noqa: BLE001  re-raised in the main thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name="fsdp-fuzz-ranks", daemon=True)
    thread.start()
    tty = sys.stderr.isatty()
    shown, last_print = "", 0.0
    try:
        while thread.is_alive():
            thread.join(PROGRESS_INTERVAL_S)
            line = _read(progress_file)
            now = time.monotonic()
            if line and line != shown and (tty or now - last_print >= PROGRESS_LINE_S):
                sys.stderr.write("\r\x1b[2K" + line if tty else line + "\n")
                sys.stderr.flush()
                shown, last_print = line, now
        if tty and shown:
            sys.stderr.write("\n")
    finally:
        runtime.close()  # interrupted: this kills the ranks
    if "error" in outcome:
        raise outcome["error"]
    return usage.ranks_verdict(outcome["result"])


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as stream:
            return stream.read().strip()
    except OSError:
        return ""


def add_parser(commands: Any) -> None:
    fuzz = usage._subcommand(
        commands,
        "fuzz",
        "generated models and training programs, FSDP vs DDP, shrunk to a repro.py",
        "Differential fuzzing (docs/fuzz.md): hypothesis draws small models, a nested wrap "
        "plan, a wrap config and a training program from the features the adapter declares, "
        "and checks that the FSDP run matches a DDP run (losses, norms, full parameters), that "
        "every hook sees a legal training state and that no rank hangs. A failure is shrunk "
        "to a minimal case, printed, and written as a standalone reproduction (--out).",
        "fsdp-conformance fuzz --examples 200 --seed 0",
        "fsdp-conformance fuzz --impl torch-fsdp2 --max-seconds 120 --out fsdp2_repro.py",
    )
    usage._add_impl(fuzz)
    examples = f"generated cases to run, refused ones not counted (default {DEFAULT_EXAMPLES})"
    fuzz.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES, metavar="N", help=examples)
    seed = "hypothesis seed (default 0)"
    fuzz.add_argument("--seed", type=int, default=0, metavar="S", help=seed)
    fuzz.add_argument("--world-size", type=int, default=2, metavar="W", help="ranks (default 2)")
    stop = "stop generating (or shrinking) after T seconds"
    fuzz.add_argument("--max-seconds", type=float, default=None, metavar="T", help=stop)
    out = f"where a counterexample's reproduction is written (default {DEFAULT_OUT})"
    fuzz.add_argument("--out", default=DEFAULT_OUT, metavar="FILE", help=out)
    hang = (
        "fail the ranks (a hang) after this long in all (default: 3600, or 2 x --max-seconds + 300)"
    )
    fuzz.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help=hang)
    fuzz.set_defaults(handler=_fuzz_command)
