"""``fsdp-conformance run --launcher torchrun``: the suite as one SPMD job under torchrun.

The CLI turns its pytest command into
``python -m torch.distributed.run --nnodes N --nproc-per-node M (--standalone |
--rdzv-backend c10d --rdzv-endpoint HOST:PORT) -m pytest ...``; every process of the job runs
the same pytest session and the plugin's launcher mode (``fsdp_conformance.harness.launcher``)
runs each check in place. Only rank 0 writes the CLI's results and ``--junit``, so the matrix
is printed by the command on the node that hosts rank 0; on the other nodes the command prints
where to look and exits with torchrun's status.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

# `run --launcher` choices: spawn ranks, or one torchrun job (the plugin's --fsdp-launcher,
# constants.LAUNCHERS, also has "auto", which the CLI never passes)
CLI_LAUNCHERS = ("none", "torchrun")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--launcher``, ``--nnodes``, ``--nproc-per-node`` and ``--rdzv-endpoint`` to
    ``run``'s parser."""
    parser.add_argument(
        "--launcher",
        choices=CLI_LAUNCHERS,
        default="none",
        help="'torchrun': run the suite as one torchrun job (every process runs each check in "
        "place; multi-node: run the same command on every node); default: spawn ranks",
    )
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
    """The one-line problem with the launcher options, or None when they are usable (under
    torchrun, ``-n`` and ``--mode`` must keep their defaults)."""
    if args.launcher != "torchrun":
        for option, value in (
            ("--nnodes", args.nnodes),
            ("--nproc-per-node", args.nproc_per_node),
            ("--rdzv-endpoint", args.rdzv_endpoint),
        ):
            if value is not None:
                return f"{option} needs --launcher torchrun"
        return None
    if args.nnodes is not None and args.nnodes < 1:
        return f"--nnodes {args.nnodes}: give at least 1"
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        return f"--nproc-per-node {args.nproc_per_node}: give at least 1"
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
    """``pytest_command`` (``[python, "-m", "pytest", ...]``, without ``-n``) as a torchrun job
    (``args`` already passed :func:`check`)."""
    assert pytest_command[1:3] == ["-m", "pytest"], pytest_command
    nproc = args.nproc_per_node or args.world_size
    command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={args.nnodes or 1}",
               f"--nproc-per-node={nproc}"]  # fmt: skip
    if args.rdzv_endpoint is None:
        command.append("--standalone")
    else:
        command += ["--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}"]
    return command + pytest_command[1:] + ["--fsdp-launcher=torchrun"]


def no_results_here(returncode: int, log_path: str) -> int:
    """What ``run`` says on a node without rank 0 (no results came back here)."""
    status = "ended" if returncode == 0 else f"failed (exit {returncode})"
    print(
        f"fsdp-conformance run: this node's torchrun processes {status}; the matrix is "
        f"printed by the command on the node of rank 0. Output here: {log_path}",
        file=sys.stderr,
    )
    return returncode


def uses_torchrun(args: Any) -> bool:
    """Whether ``run`` was asked for a torchrun job."""
    return getattr(args, "launcher", "none") == "torchrun"
