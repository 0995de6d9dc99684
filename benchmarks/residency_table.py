"""The measured residency table of docs/memory_bound.md (peak resident non-root buffers).

Runs `fsdp_conformance.suite.memory_bound.measure_residency` (a root + 6 wrapped Linears,
FULL_SHARD, 3 iterations, world size 2 on gloo) for every prefetch setting with
limit_all_gathers on and off, and prints one Markdown row per config: iteration 1/2/3 peaks as
forward/backward, bold where the per-phase bound is exceeded.

    python benchmarks/residency_table.py --impl torch-fsdp1 --lag strict
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PREFETCH_CONFIGS = [
    (None, False),
    ("BACKWARD_PRE", False),
    ("BACKWARD_POST", False),
    (None, True),
    ("BACKWARD_PRE", True),
    ("BACKWARD_POST", True),
]


def rows(impl: str, lag: str) -> list[str]:
    from fsdp_conformance.adapters import Feature, features, get_adapter
    from fsdp_conformance.suite.memory_bound import (
        ITERATIONS,
        OWN_BOUNDS,
        BoundCase,
        measure_residency,
    )

    adapter = get_adapter(impl)
    own_bound = OWN_BOUNDS.get(impl)  # torch-fsdp2: its stream-ordered bound, not the limiter's
    limits = (True, False) if features.supports(adapter, Feature.LIMIT_ALL_GATHERS_OFF) else (True,)
    out = []
    for limit in limits:
        for backward, forward in PREFETCH_CONFIGS:
            case = BoundCase(lag, "FULL_SHARD", backward, forward, limit)
            tracker = measure_residency(adapter, dist.group.WORLD, case.wrap_config, lag)
            bound = case.bound if own_bound is None else own_bound.bound
            cells = []
            for iteration in range(1, ITERATIONS + 1):
                phases = []
                for phase in ("forward", "backward"):
                    peak = tracker.peak(iteration, phase).resident
                    over = limit and peak > bound(phase)
                    phases.append(f"**{peak}**" if over else str(peak))
                cells.append(" / ".join(phases))
            bounds = f"{bound('forward')} / {bound('backward')}" if limit else "-"
            out.append(
                f"| {impl} | {lag} | {limit} | {backward} | {forward} | {bounds} | "
                + " | ".join(cells)
                + " |"
            )
    return out


def rank_main(rank: int, store: str, impl: str, lag: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    table = rows(impl, lag)
    if rank == 0:
        print("\n".join(table), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="impl")
    parser.add_argument("--lag", default="strict", choices=["strict", "drained"])
    args = parser.parse_args()
    print(
        f"# {datetime.date.today()} torch {torch.__version__} on {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs"
    )
    print(
        "| adapter | lag | limit_all_gathers | backward_prefetch | forward_prefetch | bound fwd / bwd "
        "| iteration 1 fwd / bwd | iteration 2 fwd / bwd | iteration 3 fwd / bwd |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    store = os.path.join(tempfile.mkdtemp(), "store")
    mp.spawn(rank_main, args=(store, args.impl, args.lag), nprocs=2)


if __name__ == "__main__":
    main()
