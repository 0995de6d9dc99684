"""``fsdp-conformance overlap``: the suite's overlap-timing experiment in a rank set, as a table."""

from __future__ import annotations

import argparse
from typing import Any

from fsdp_conformance.cli import usage
from fsdp_conformance.constants import Op


def _overlap_command(args: argparse.Namespace) -> int:
    usage.check_impl(args.impl)
    why = "a one-rank group all-gathers nothing, so there is no communication to overlap; use 2"
    usage.check_at_least(args.world_size, "--world-size", 2, why)
    usage.check_world_size(args.world_size)
    usage.check_at_least(args.repeats, "--repeats")
    usage.check_output(args.json, "--json")
    if cuda := args.device == "cuda":
        from fsdp_conformance.harness import gpus

        if gpus.gpu_count() == 0:
            raise usage.UsageError("--device cuda: needs a GPU, none available; use --device cpu")
    kwargs = {"limit_all_gathers": args.limit_all_gathers, "repeats": args.repeats}
    # on CUDA: nccl with a GPU per rank, else the ranks share one GPU over gloo
    backend, gpus_needed = (None, 1) if cuda else ("gloo", 0)
    if (document := usage.measure_in_ranks("overlap", kwargs, args, backend, gpus_needed)) is None:
        return 1
    print(render_overlap(document))
    if args.json:
        usage.write_json(args.json, document, indent=2)
    return 0


def render_overlap(document: dict[str, Any]) -> str:
    """The overlap table, the ratio and what it means."""
    times = document["times"]
    cuda = document["device"] == "cuda"
    unit = "device ms" if cuda else "ms"
    config = ", ".join(f"{key}={value}" for key, value in document["config"].items())
    rows = [
        ("nothing (no delays)", times["nothing"]),
        (f"communication only ({document['comm_ms']:g} ms per all-gather)", times[Op.ALL_GATHER]),
        (f"compute only ({document['compute_ms']:g} ms per layer)", times["compute"]),
        ("both", times["both"]),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [
        f"overlap of {document['impl']!r} on {document['placement']} (world size "
        + f"{document['world_size']}, {document['layers']} layers, {config})",
        f"forward time, minimum of {document['repeats']} runs, maximum over ranks:",
        "",
        f"  {'case':<{width}}  {unit:>10}",
        *(f"  {name:<{width}}  {value:10.1f}" for name, value in rows),
        "",
        f"all-gathers per forward: {times['all_gathers']} ({times['synchronous']} synchronous)",
    ]
    if cuda:
        lines.append(
            f"overlap ratio (compute + communication) / both = {document['ratio']:.2f} "
            "(> 1.1: overlapped)"
        )
    else:
        communication = times["all_gathers"] * document["comm_ms"]
        serialised = communication + times["compute"] - times["nothing"]
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
    lines.append(f"verdict: {document['failure'] or 'communication overlaps computation'}")
    return "\n".join(lines)


def add_parser(commands: Any) -> None:
    overlap = usage._subcommand(
        commands,
        "overlap",
        "time compute only / communication only / both and print the overlap ratio",
        "Reproduce the suite's overlap-timing experiment (fsdp_conformance.suite.overlap): 4 "
        "FSDP layers under a root, each computing for a fixed time, each all-gather delayed; "
        "the forward is timed with nothing / communication only / compute only / both (the "
        "minimum of --repeats runs, the maximum over ranks). Prints the table, the overlap "
        "ratio and the suite's verdict.",
        "fsdp-conformance overlap --limit-all-gathers false",
        "fsdp-conformance overlap --impl torch-fsdp1 --limit-all-gathers true",
        "fsdp-conformance overlap --device cuda --json overlap.json",
    )
    usage._add_common(overlap, "ranks (default 2)")
    limiter = "the rate limiter setting (default false)"
    overlap.add_argument(
        "--limit-all-gathers", type=usage._bool, default=False, metavar="true|false", help=limiter
    )
    overlap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    repeats = "runs per case, Min-k (default 4)"
    overlap.add_argument("--repeats", type=int, default=4, metavar="K", help=repeats)
    overlap.add_argument("--json", metavar="FILE", help="write the measurement as JSON")
    overlap.set_defaults(handler=_overlap_command)
