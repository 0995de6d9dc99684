"""``fsdp-conformance timeline``: resident unsharded buffers with the limiter on and off,
measured in a rank set (``cli.ranks``), drawn by ``cli.draw``."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from fsdp_conformance import constants
from fsdp_conformance.cli import draw, usage


def _timeline_command(args: argparse.Namespace) -> int:
    usage.check_impl(args.impl)
    usage.check_world_size(args.world_size, minimum=2)
    usage.check_at_least(args.iterations, "--iterations")
    why = "the bound only shows with >= 4 instances (default 6)"
    usage.check_at_least(args.layers, "--layers", 4, why)
    for path, option in ((args.out, "--out"), (args.data, "--data"), (args.trace, "--trace")):
        usage.check_output(path, option)
    try:
        import matplotlib  # noqa: F401  (imported again, for drawing, in cli.draw)
    except ImportError as error:
        raise usage.UsageError(
            "the timeline picture needs matplotlib, which cannot be imported "
            f"({error}): pip install matplotlib"
        ) from None
    names = ("lag", "iterations", "layers", "backward_prefetch", "forward_prefetch")
    kwargs = {name: getattr(args, name) for name in names}
    kwargs["trace_file"] = os.path.abspath(args.trace) if args.trace else None
    if (document := usage.measure_in_ranks("timeline", kwargs, args, "gloo")) is None:
        return 1
    document["axes_drawn"] = draw.draw(document, args.out)
    print(render_timeline(document))
    written = [f"{args.out} ({document['axes_drawn']} panels)"]
    if args.data:
        usage.write_json(args.data, document, indent=1)
        written.append(args.data)
    if args.trace:
        with open(args.trace, encoding="utf-8") as stream:
            trace = json.load(stream)
        events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
        name = constants.RATE_LIMITER_RANGE
        ranges = sum(1 for event in events if event.get("name") == name and event.get("ph") == "X")
        written.append(f"{args.trace} (Chrome trace: {ranges} {name} ranges)")
    print("wrote " + ", ".join(written))
    return 0


def render_timeline(document: dict[str, Any]) -> str:
    """Peak resident non-root buffers per iteration and phase, next to the bound."""
    lines = [
        f"resident unsharded buffers of {document['impl']!r}: {document['layers']} instances "
        + f"under a root, {document['lag']} lagging device, world size {document['world_size']}",
        f"bound: {document['panels'][0]['bound_name']}" if document["panels"] else "",
        "",
        "  limit_all_gathers  iteration  phase     peak  bound",
    ]
    for panel in document["panels"]:
        over = {(peak["iteration"], peak["phase"]) for peak in panel["over"]}
        for peak in panel["peaks"]:
            mark = "  over the bound" if (peak["iteration"], peak["phase"]) in over else ""
            lines.append(
                f"  {panel['limit_all_gathers']!s:<17}  {peak['iteration']:>9}  "
                f"{peak['phase']:<8}  {peak['resident']:>4}  {peak['bound']:>5}{mark}"
            )
    for panel in document["panels"]:
        lines.append(f"limit_all_gathers={panel['limit_all_gathers']}: {draw.verdict(panel)}")
    return "\n".join(lines)


def add_parser(commands: Any) -> None:
    timeline = usage._subcommand(
        commands,
        "timeline",
        "draw resident unsharded buffers over time with limit_all_gathers on and off",
        "Train a chain of --layers FSDP instances under a root on the lagging device "
        "(fsdp_conformance.observe), with limit_all_gathers=True and False, counting resident "
        "unsharded buffers after every event. Draws two panels (the bound dashed), prints the "
        "peaks per phase, and optionally writes the data and a Chrome trace of the limited "
        "run. Needs matplotlib.",
        "fsdp-conformance timeline --out timeline.png",
        "fsdp-conformance timeline --impl torch-fsdp1 --lag drained --data timeline.json",
        "fsdp-conformance timeline --trace trace.json   # open in chrome://tracing or Perfetto",
    )
    usage._add_common(timeline, "ranks (default 2, at least 2)")
    lag = (
        "strict: the device never catches up by itself (default); drained: it catches up at the "
        "end of every iteration"
    )
    timeline.add_argument("--lag", choices=("strict", "drained"), default="strict", help=lag)
    timeline.add_argument("--out", default="timeline.png", metavar="FILE.png")
    timeline.add_argument("--data", metavar="FILE.json", help="write the plotted data as JSON")
    trace = "write a Chrome trace (torch.profiler) of rank 0"
    timeline.add_argument("--trace", metavar="FILE.json", help=trace)
    timeline.add_argument("--iterations", type=int, default=3, metavar="N")
    timeline.add_argument("--layers", type=int, default=6, metavar="N", help="instances (>= 4)")
    timeline.add_argument(
        "--backward-prefetch", default="BACKWARD_PRE", metavar="BACKWARD_PRE|BACKWARD_POST|none",
        type=lambda text: None if text.lower() == "none" else text.upper(),
        choices=("BACKWARD_PRE", "BACKWARD_POST", None),
    )  # fmt: skip
    timeline.add_argument("--forward-prefetch", action="store_true")
    timeline.set_defaults(handler=_timeline_command)
