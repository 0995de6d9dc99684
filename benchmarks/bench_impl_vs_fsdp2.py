"""Reference FSDP vs torch FSDP2: step time and peak RSS, same model, same run, world size 2, CPU.

    python benchmarks/bench_impl_vs_fsdp2.py [--steps 10] [--rounds 3]

The model, optimizer and measurement are those of ``bench_impl_vs_fsdp1.py`` (the ~20M-parameter
transformer encoder, each layer its own instance, SGD+momentum, fresh rank processes per
measurement, alternating rounds, median of per-round median steps, peak RSS max over ranks).
The reference FSDP runs FULL_SHARD, BACKWARD_PRE, limit_all_gathers=True; torch FSDP2 runs
``fully_shard`` on each layer and the root with its defaults (reshard after forward for the
layers, implicit backward prefetch, its own stream-ordered memory bound) on a CPU mesh. Prints
both and the ratios impl / FSDP2.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import torch
from bench_impl_vs_fsdp1 import WORLD_SIZE, Transformer, measure

NAMES = ("impl", "torch-fsdp2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.steps < 1 or args.rounds < 1:
        parser.error(f"--steps {args.steps} / --rounds {args.rounds}: give counts >= 1")
    params = sum(p.numel() for p in Transformer().parameters())
    print(
        f"{params / 1e6:.1f}M parameters, world size {WORLD_SIZE}, {args.steps} steps x "
        f"{args.rounds} rounds, torch {torch.__version__}, {platform.machine()} "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in NAMES}
    for round_index in range(args.rounds):
        for name in NAMES:
            runs[name].append(measure(name, args.steps))
            step, rss, loss = runs[name][-1]
            print(
                f"  round {round_index} {name:12s} median step {step * 1000:8.1f} ms   "
                f"peak RSS {rss:7.1f} MiB   last loss {loss:.4f}",
                flush=True,
            )
    summary = {
        name: (statistics.median(r[0] for r in rows), max(r[1] for r in rows))
        for name, rows in runs.items()
    }
    for name, (step, rss) in summary.items():
        print(f"{name:12s} median step {step * 1000:8.1f} ms   peak RSS {rss:8.1f} MiB")
    (impl_step, impl_rss), (ref_step, ref_rss) = summary["impl"], summary["torch-fsdp2"]
    print(f"ratio impl/fsdp2: time {impl_step / ref_step:.3f}, memory {impl_rss / ref_rss:.3f}")


if __name__ == "__main__":
    main()
