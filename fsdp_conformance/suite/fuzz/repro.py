"""Reproductions: ``write_repro`` writes a standalone ``repro.py`` for a failing case, whose
``main`` runs the case once on local ranks and ends with one line saying which it is: exit 1
(``STILL_FAILS``) while the failure persists, 0 (``PASSES``) once it is gone, 2 (``CANNOT_RUN``)
when the case cannot run here at all -- never 1 for a reproduction that did not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import textwrap
from typing import Any

from fsdp_conformance.adapters import features as adapter_features

from .compare import DEVIATION, FAIL, OK, UNSUPPORTED, Outcome, combine, run_case
from .spec import FuzzCase, describe

_TEMPLATE = '''\
#!/usr/bin/env python
"""A failing case found by `fsdp-conformance fuzz --impl {impl} --seed {seed}` (world size
{world_size}), shrunk by hypothesis. Run it to see whether it still fails:

    python {name}                       # exit 1 while it fails, 0 once fixed, 2: cannot run
    python {name} --impl torch-fsdp2    # the same case on another implementation

{description}

First difference when found:
{message}
"""

import sys

try:
    from fsdp_conformance.suite.fuzz.repro import main
    from fsdp_conformance.suite.fuzz.spec import Block, FuzzCase, ModelSpec, Program, Seq, Step
except ImportError as error:
    print(
        f"cannot run (exit 2): fsdp-conformance does not import here ({{error}}); run this "
        "file with the Python that has fsdp-conformance installed",
        file=sys.stderr,
    )
    sys.exit(2)

CASE = {case}
IMPL = {impl!r}
WORLD_SIZE = {world_size}

if __name__ == "__main__":
    sys.exit(main(CASE, IMPL, WORLD_SIZE, sys.argv[1:]))
'''


def repro_source(
    case: FuzzCase, impl: str, world_size: int, seed: int, message: str, name: str = "repro.py"
) -> str:
    """The text of a standalone reproduction of ``case``."""
    return _TEMPLATE.format(
        impl=impl,
        seed=seed,
        world_size=world_size,
        name=name,
        description=textwrap.indent(describe(case, world_size), "    "),
        message=textwrap.indent(_short(message), "    "),
        case=_pretty(case),
    )


def write_repro(
    path: str, case: FuzzCase, impl: str, world_size: int, seed: int, message: str
) -> None:
    """Write ``repro_source`` to ``path``."""
    with open(path, "w", encoding="utf-8") as stream:
        stream.write(repro_source(case, impl, world_size, seed, message, os.path.basename(path)))


def _short(message: str, lines: int = 12) -> str:
    parts = message.replace('"""', "'''").splitlines()
    if len(parts) > lines:
        parts = parts[:2] + ["..."] + parts[-(lines - 3) :]
    return "\n".join(parts)


def _pretty(value: Any, indent: int = 0, width: int | None = 96) -> str:
    """``value`` (a case, or a part of one) as Python source, one constructor per line where it
    does not fit in ``width`` (None: all on one line); fields at their defaults left out."""
    if dataclasses.is_dataclass(value):
        head = f"{type(value).__name__}("
        fields = [
            (f"{f.name}=", getattr(value, f.name), f.default) for f in dataclasses.fields(value)
        ]
        parts = [(name, item) for name, item, default in fields if item != default]
    elif isinstance(value, tuple):
        head, parts = "(", [("", item) for item in value]
    else:
        return repr(value)
    single = "," if head == "(" and len(parts) == 1 else ""
    flat = head + ", ".join(name + _pretty(item, 0, None) for name, item in parts) + single + ")"
    if width is None or len(flat) + indent * 4 <= width:
        return flat
    pad = "    " * (indent + 1)
    items = [f"{pad}{name}{_pretty(item, indent + 1, width)}," for name, item in parts]
    return head + "\n" + "\n".join(items) + "\n" + "    " * indent + ")"


def repro_in_rank(dist: Any, case: FuzzCase, out_file: str) -> None:
    """Run ``case`` once in every rank; rank 0 writes the combined outcome as JSON."""
    import torch
    import torch.distributed as tdist

    from fsdp_conformance.adapters import get_adapter

    torch.set_num_threads(1)  # as the fuzzing loop runs it (the harness restores it)
    outcome = run_case(get_adapter(dist.impl), case, dist)
    gathered: list[Any] = [None] * dist.world_size
    tdist.all_gather_object(gathered, outcome)
    if dist.rank == 0:
        combined = combine(gathered)
        with open(out_file, "w", encoding="utf-8") as stream:
            json.dump({"kind": combined.kind, "message": combined.message}, stream)


class CannotRun(RuntimeError):
    """The reproduction could not run its case here (repro.py exits ``CANNOT_RUN``)."""


def run_in_ranks(case: FuzzCase, impl: str, world_size: int, timeout: float = 600.0) -> Outcome:
    """``case`` run once on ``world_size`` fresh local ranks against ``impl``.

    Raises:
        CannotRun: the ranks skipped the case (it needs what this host lacks).
    """
    from fsdp_conformance.harness.controller import run_function

    with tempfile.TemporaryDirectory(prefix="fsdp-fuzz-repro-", ignore_cleanup_errors=True) as tmp:
        out_file = os.path.join(tmp, "outcome.json")
        result = run_function(
            "fsdp_conformance.suite.fuzz.repro",
            "repro_in_rank",
            {"case": case, "out_file": out_file},
            world_size=world_size,
            timeout=timeout,
            impl=impl,
            test_id="fsdp-conformance fuzz repro",
        )
        if result.verdict.status == "skipped":  # e.g. the ranks lack the GPUs the case needs
            raise CannotRun(f"the ranks skipped: {result.verdict.message}")
        if result.verdict.status != "passed":
            return Outcome(FAIL, f"the ranks {result.verdict.status}: {result.verdict.message}")
        with open(out_file, encoding="utf-8") as stream:
            data = json.load(stream)
        return Outcome(data["kind"], data["message"])


# repro.py's exit codes
PASSES = 0
STILL_FAILS = 1
CANNOT_RUN = 2


def cannot_run_reason(impl: str) -> str | None:
    """Why a reproduction cannot run against ``impl`` here (torch or the adapter does not
    import, its extra is missing, torch is outside its supported range), or None."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # pkg.module:ATTR adapters next to the script
    from fsdp_conformance.harness.extras import missing_extra

    problem = missing_extra(impl)
    if problem is not None:
        return problem
    try:
        from fsdp_conformance.adapters import get_adapter

        adapter = get_adapter(impl)
    except Exception as error:  # noqa: BLE001  whatever stops the adapter from loading
        return " ".join(f"--impl {impl}: {type(error).__name__}: {error}".split())
    support = adapter_features.support_problem(adapter)
    if support is not None:
        return f"adapter {adapter.name!r}: {support}"
    return None


def main(case: FuzzCase, impl: str, world_size: int, argv: list[str] | None = None) -> int:
    """A reproduction script's entry point: ``STILL_FAILS`` (1) while ``case`` fails on
    ``impl``, ``PASSES`` (0) once it does not, ``CANNOT_RUN`` (2) when it cannot run here; the
    last line printed says which."""
    parser = argparse.ArgumentParser(
        description="Run a reproduction written by fsdp-conformance fuzz. Exit codes: 0 passes "
        "now, 1 still fails, 2 cannot run here (import error, missing adapter, torch outside "
        "the adapter's range, bad option)."
    )
    parser.add_argument("--impl", default=impl, help=f"the adapter (default {impl!r})")
    parser.add_argument(
        "--world-size", type=int, default=world_size, help=f"ranks (default {world_size})"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a hang fails")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error(f"--world-size {args.world_size}: must be >= 1")
    problem = cannot_run_reason(args.impl)
    if problem is not None:
        print(f"cannot run (exit {CANNOT_RUN}): {problem}", file=sys.stderr)
        return CANNOT_RUN
    print(describe(case, args.world_size))
    print(f"running on {args.world_size} local ranks against --impl {args.impl} ...", flush=True)
    try:
        outcome = run_in_ranks(case, args.impl, args.world_size, args.timeout)
    except CannotRun as error:
        print(f"cannot run (exit {CANNOT_RUN}): {error}", file=sys.stderr)
        return CANNOT_RUN
    if outcome.kind == FAIL:
        print(f"FAILS: {outcome.message}")
        print(f"still fails (exit {STILL_FAILS})")
        return STILL_FAILS
    print(
        {
            OK: "passes: the FSDP run matches DDP (the failure is gone)",
            UNSUPPORTED: f"refused with a clear error (not a failure): {outcome.message}",
            DEVIATION: f"fails as the adapter declares (a known deviation): {outcome.message}",
        }[outcome.kind]
    )
    print(f"passes now (exit {PASSES})")
    return PASSES
