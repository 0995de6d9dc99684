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

from bench_impl_vs_fsdp1 import compare


def main() -> None:
    compare("torch-fsdp2", __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
