"""``fsdp-conformance run --launcher torchrun``: the suite as one SPMD job under torchrun
(every process runs the same pytest session, each check in place). Only rank 0 writes the
results, so the matrix is printed on its node; the other nodes say where to look.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

# spawn ranks, or one torchrun job (the plugin's --fsdp-launcher also has "auto")
CLI_LAUNCHERS = ("none", "torchrun")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--launcher", choices=CLI_LAUNCHERS, default="none",
        help="'torchrun': run the suite as one torchrun job (every process runs each check in "
        "place; multi-node: run the same command on every node); default: spawn ranks",
    )  # fmt: skip
    parser.add_argument("--nnodes", type=int, metavar="N", help="torchrun: nodes (default 1)")
    parser.add_argument(
        "--nproc-per-node", type=int, metavar="M",
        help="torchrun: processes per node (default: --world-size)",
    )  # fmt: skip
    parser.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT",
        help="torchrun: c10d rendezvous (needed with --nnodes > 1; default: --standalone)",
    )  # fmt: skip


def check(args: argparse.Namespace, default_workers: int, default_mode: str) -> str | None:
    """The one-line problem with the launcher options, or None."""
    options = ("--nnodes", "--nproc-per-node", "--rdzv-endpoint")  # torchrun's own
    given = {option: getattr(args, option[2:].replace("-", "_")) for option in options}
    if args.launcher != "torchrun":
        extra = next((option for option, value in given.items() if value is not None), None)
        return None if extra is None else f"{extra} needs --launcher torchrun"
    for option in options[:2]:
        if given[option] is not None and given[option] < 1:
            return f"{option} {given[option]}: give at least 1"
    if (args.nnodes or 1) > 1 and args.rdzv_endpoint is None:
        return (
            f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node, "
            "e.g. the first node's address and a free port)"
        )
    if args.rdzv_endpoint is not None:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return f"--rdzv-endpoint {args.rdzv_endpoint!r}: give HOST:PORT, e.g. node0:29400"
    if args.workers not in (0, default_workers):
        return f"-n {args.workers}: the torchrun job runs without pytest-xdist (give -n 0)"
    if args.mode != default_mode:
        return f"--mode {args.mode}: under --launcher torchrun checks run in place (drop --mode)"
    return None


def torchrun_command(args: argparse.Namespace, pytest_command: list[str]) -> list[str]:
    """``pytest_command`` (``[python, "-m", "pytest", ...]``, no ``-n``) as a torchrun job."""
    assert pytest_command[1:3] == ["-m", "pytest"], pytest_command
    command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={args.nnodes or 1}",
               f"--nproc-per-node={args.nproc_per_node or args.world_size}"]  # fmt: skip
    if args.rdzv_endpoint is None:
        command.append("--standalone")
    else:
        command += ["--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}"]
    return command + pytest_command[1:] + ["--fsdp-launcher=torchrun"]


def no_results_here(returncode: int, log_path: str) -> int:
    """What ``run`` says on a node without rank 0."""
    status = "ended" if returncode == 0 else f"failed (exit {returncode})"
    print(
        f"fsdp-conformance run: this node's torchrun processes {status}; the matrix is "
        f"printed by the command on the node of rank 0. Output here: {log_path}",
        file=sys.stderr,
    )
    return returncode


def uses_torchrun(args: Any) -> bool:
    return getattr(args, "launcher", "none") == "torchrun"
