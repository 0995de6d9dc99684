"""Wall time of ``fsdp-conformance run --impl impl`` beside the pytest collection of the same suite.

Each round runs, in fresh processes and in a private temporary directory:

- ``pytest --collect-only`` of the suite with the options ``run`` passes (what every run pays
  before its first cell);
- ``fsdp-conformance run --impl impl --json ...`` (the default: pairwise coverage, 2 xdist
  workers), whose JSON gives the cells and the seconds each took.

It prints one Markdown row per round and the median, and the cells that took longest in the
last round (where the time goes). The machine's load average is printed too: on a shared host
compare runs made in the same conditions.

    python benchmarks/bench_run.py              # 3 rounds
    python benchmarks/bench_run.py --rounds 1 -k parity
    python benchmarks/bench_run.py --update-docs   # the medians into docs/figures.json and the docs

CPU time is user + sys of every process the run waited for (as ``/usr/bin/time`` counts it).

Seconds do not compare across machines (the same tree took 48 CPU-s here and 82-88 on another
2-core VM), so each round also times a fixed **calibration workload** in fresh processes --
importing torch, a fixed single-threaded compute loop, and a 2-rank gloo all-reduce loop (the
three things a conformance run spends its time on) -- and states the run's cost in that unit:
``units = run CPU-s / calibration CPU-s`` (median over the rounds), comparable across machines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def _timed(command: list[str], cwd: str) -> tuple[float, float]:
    """Wall and CPU seconds (user + sys of the processes waited for) of ``command``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return time.monotonic() - started, cpu


# the calibration workload: run as ``python -c CALIBRATION`` (the parent computes, then starts
# its two all-reduce ranks as ``python -c CALIBRATION <rank> <store file>``)
CALIBRATION = """
import subprocess, sys, tempfile, os
import torch
torch.set_num_threads(1)
if len(sys.argv) == 1:
    torch.manual_seed(0)
    a = torch.randn(256, 256) / 16
    for _ in range(400):
        a = torch.tanh(a @ a)
    store = os.path.join(tempfile.mkdtemp(prefix="calibration-"), "store")
    ranks = [subprocess.Popen([sys.executable, "-c", __CODE__, str(r), store]) for r in (0, 1)]
    sys.exit(max(rank.wait(timeout=300) for rank in ranks))
import torch.distributed as dist
rank, store = int(sys.argv[1]), dist.FileStore(sys.argv[2], 2)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
x = torch.ones(1 << 16)
for _ in range(300):
    dist.all_reduce(x)
dist.destroy_process_group()
"""


def calibrate(directory: str) -> tuple[float, float]:
    """Wall and CPU seconds of the calibration workload."""
    code = CALIBRATION.replace("__CODE__", repr(CALIBRATION))
    return _timed([sys.executable, "-c", code], directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--impl", default="impl", help="the --impl to run (default impl)")
    parser.add_argument("-k", default=None, help="only checks matching this -k expression")
    parser.add_argument("--slowest", type=int, default=10, help="slowest cells to list")
    parser.add_argument(
        "--update-docs", action="store_true",
        help="record the medians as the figure run-impl (docs/figures.json) and rewrite the docs",
    )  # fmt: skip
    args = parser.parse_args()
    if args.update_docs and (args.impl != "impl" or args.k):
        parser.error("--update-docs records the default run: drop --impl and -k")
    load_before = os.getloadavg()[0]

    from fsdp_conformance.cli import records

    selection = ["-k", args.k] if args.k else []
    collect = records.suite_command(
        args.impl, "--fsdp-coverage=pairwise", "--collect-only", "-p", "no:xdist", *selection
    )
    rows = []
    cells: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-run-") as directory:
        matrix = os.path.join(directory, "matrix.json")
        run = [sys.executable, "-m", "fsdp_conformance.cli", "run", "--impl", args.impl]
        run += ["--json", matrix, *selection]
        for round_number in range(1, args.rounds + 1):
            calibration_s = calibrate(directory)[1]
            collect_s = _timed(collect, directory)[0]
            run_s, cpu_s = _timed(run, directory)
            with open(matrix, encoding="utf-8") as stream:
                cells = json.load(stream)["cells"]
            durations = sum(c["duration"] for c in cells)
            rows.append((collect_s, run_s, len(cells), durations, cpu_s, calibration_s))
            print(
                f"round {round_number}: run {run_s:.1f} s, {cpu_s:.1f} CPU-s, calibration "
                f"{calibration_s:.1f} CPU-s",
                file=sys.stderr,
            )

    import torch

    print(
        f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}, "
        f"--impl {args.impl}" + (f", -k {args.k!r}" if args.k else "")
    )
    print(
        "| round | collection s | run s | cells | sum of cell s | run CPU s | calibration CPU s "
        "| run in calibration units |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for number, (collect_s, run_s, count, cell_s, cpu_s, calibration_s) in enumerate(rows, 1):
        print(
            f"| {number} | {collect_s:.1f} | {run_s:.1f} | {count} | {cell_s:.1f} | {cpu_s:.1f} "
            f"| {calibration_s:.1f} | {cpu_s / calibration_s:.2f} |"
        )
    median = [statistics.median(row[i] for row in rows) for i in range(6)]
    units = statistics.median(row[4] / row[5] for row in rows)
    print(
        f"| median | {median[0]:.1f} | {median[1]:.1f} | {median[2]:.0f} | {median[3]:.1f} "
        f"| {median[4]:.1f} | {median[5]:.1f} | {units:.2f} |"
    )
    print("\nslowest cells of the last round (setup + call + teardown, s):")
    for cell in sorted(cells, key=lambda c: -c["duration"])[: args.slowest]:
        print(f"  {cell['duration']:6.1f}  {cell['check']}[{cell['configuration']}]")
    load = os.getloadavg()
    print(f"load average after the run: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if args.update_docs:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import figures

        recorded = figures.load()
        recorded["run-impl"] = {
            "command": "fsdp-conformance run --impl impl", "wall_s": round(median[1], 1),
            "cpu_s": round(median[4], 1), "cells": round(median[2]), "load": round(load_before, 1),
            "calibration_cpu_s": round(median[5], 1), "units": round(units, 2),
            "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}",
            "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}",
        }  # fmt: skip
        figures.rewrite(recorded)


if __name__ == "__main__":
    main()
