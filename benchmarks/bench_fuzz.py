"""Examples per second of the differential fuzzer (``fsdp-conformance fuzz``) at world size 2.

Runs the fuzzing loop of ``fsdp_conformance.suite.fuzz`` (default program size: up to 3 steps of up to
3 micro-batches, up to 4 nodes per container, 2 nesting levels) in one rank set per
implementation, at a fixed seed, and reports examples per second measured inside the ranks (rank
start-up excluded: it is paid once per run, not per example), the refused cases, and the
harness's own cost per example (a broadcast of the case and a gather of the outcomes, measured
by running the same loop with a case that does nothing). Rank 0's CPU seconds per case is the
load-independent cost: on an otherwise idle machine with a core per rank, examples/s is about
its inverse.

    python benchmarks/bench_fuzz.py                        # impl, torch-fsdp1, torch-fsdp2
    python benchmarks/bench_fuzz.py --impl impl --examples 50
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time

from fsdp_conformance.harness.wire import TestTarget
from fsdp_conformance.harness.controller import Runtime, RuntimeOptions, TestRequest

HERE = os.path.dirname(os.path.abspath(__file__))


def harness_cost_in_rank(dist, out_file: str, rounds: int) -> None:
    """The per-example traffic of the driver (broadcast a case, gather outcomes), timed."""
    import torch.distributed as tdist

    from fsdp_conformance.suite.fuzz.compare import OK, Outcome
    from fsdp_conformance.suite.fuzz.spec import Block, FuzzCase, ModelSpec, Seq

    case = FuzzCase(ModelSpec(4, Seq((Block("linear", 4, 4),) * 4)))
    start = time.perf_counter()
    for _ in range(rounds):
        message = [case if dist.rank == 0 else None]
        tdist.broadcast_object_list(message, src=0)
        gathered = [None] * dist.world_size
        tdist.all_gather_object(gathered, Outcome(OK))
    elapsed = time.perf_counter() - start
    if dist.rank == 0:
        with open(out_file, "w", encoding="utf-8") as stream:
            json.dump({"ms_per_example": 1000 * elapsed / rounds}, stream)


def _run(function: str, module: str, kwargs: dict, impl: str, world_size: int) -> None:
    runtime = Runtime(
        RuntimeOptions(
            mode="process", timeout=3600, world_size=world_size, impl=impl, backend="gloo"
        )
    )
    request = TestRequest(
        target=TestTarget(module, None, (), function),
        kwargs=kwargs,
        test_id=f"bench_fuzz {function}",
        world_size=world_size,
        mode="process",
        timeout=3600,
    )
    try:
        result = runtime.run(request)
    finally:
        runtime.close()
    if result.verdict.status != "passed":
        raise SystemExit(f"{impl}: the ranks {result.verdict.status}: {result.verdict.message}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", action="append", help="adapter(s) (default: the three built-ins)")
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    impls = args.impl or ["impl", "torch-fsdp1", "torch-fsdp2"]
    workdir = tempfile.mkdtemp(prefix="bench-fuzz-")
    try:
        print(
            f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, load average "
            f"{os.getloadavg()[0]:.1f}, Python {platform.python_version()}, world size "
            f"{args.world_size}, seed {args.seed}, {args.examples} examples"
        )
        out = os.path.join(workdir, "harness.json")
        _run("harness_cost_in_rank", "bench_fuzz", {"out_file": out, "rounds": 200}, "impl",
             args.world_size)  # fmt: skip
        with open(out, encoding="utf-8") as stream:
            cost = json.load(stream)["ms_per_example"]
        print(f"harness cost per example (broadcast case + gather outcomes): {cost:.2f} ms")
        print(
            "| adapter | examples | refused | examples/s | all cases/s | rank-0 CPU s per case "
            "| verdict |"
        )
        print("|---|---|---|---|---|---|---|")
        for impl in impls:
            out = os.path.join(workdir, f"{impl}.json")
            kwargs = {"out_file": out, "examples": args.examples, "seed": args.seed}
            _run(
                "fuzz_in_rank", "fsdp_conformance.suite.fuzz.driver", kwargs, impl, args.world_size
            )
            with open(out, encoding="utf-8") as stream:
                result = json.load(stream)
            cases = result["examples"] + result["unsupported"]
            every = cases / result["elapsed"]
            cpu = result["cpu_seconds"] / cases
            print(
                f"| {impl} | {result['examples']} | {result['unsupported']} | "
                f"{result['rate']:.2f} | {every:.2f} | {cpu:.3f} | {result['status']} |"
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
