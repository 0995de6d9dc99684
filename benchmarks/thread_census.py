"""The most threads any process held while a command ran (issue: no rank above 100 threads).

    python benchmarks/thread_census.py -- pytest --pyargs fsdp_conformance.suite \
        --fsdp-impl torch-fsdp1 -n 2 -q -p no:cacheprovider

Reads ``/proc/<pid>/task`` of every process under the command once a second and prints, at
the end, the command's exit code, its wall time and the largest thread count seen per process
kind (rank, zygote, pytest/xdist worker, other), with the pid that held it. Linux only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def _children() -> dict[int, int]:
    """pid -> parent pid of every process on the machine."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as stat:
                    parents[int(name)] = int(stat.read().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return parents


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kind(pid: int, parents: dict[int, int]) -> str:
    """A rank is forked by a zygote (same command line) or started as ``harness.rank``."""
    command = _command(pid)
    if "harness.rank" in command or "zygote" in _command(parents.get(pid, 0)):
        return "rank"
    if "zygote" in command:
        return "zygote"
    return "pytest" if "pytest" in command or "execnet" in command else "other"


def main(command: list[str]) -> int:
    start = time.monotonic()
    proc = subprocess.Popen(command)
    most: dict[str, tuple[int, int]] = {}  # kind -> (threads, pid)
    while proc.poll() is None:
        parents = _children()
        tree, grew = {proc.pid}, True
        while grew:
            new = {pid for pid, parent in parents.items() if parent in tree} - tree
            tree |= new
            grew = bool(new)
        for pid in tree:
            try:
                threads = len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                continue
            kind = _kind(pid, parents)
            if threads > most.get(kind, (0, 0))[0]:
                most[kind] = (threads, pid)
        time.sleep(1)
    print(f"exit {proc.returncode}, {time.monotonic() - start:.0f} s; most threads per process:")
    for kind, (threads, pid) in sorted(most.items()):
        print(f"  {kind:7s} {threads:5d}  (pid {pid})")
    return proc.returncode


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args[1:] if args[:1] == ["--"] else args))
