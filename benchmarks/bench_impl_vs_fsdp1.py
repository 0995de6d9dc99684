"""Reference FSDP vs torch FSDP1: step time and peak RSS, same model, world size 2, CPU.

    python benchmarks/bench_impl_vs_fsdp1.py [--steps 10] [--rounds 3]

Both train the same ~20M-parameter transformer encoder (each layer its own instance,
FULL_SHARD, BACKWARD_PRE, limit_all_gathers=True, torch FSDP1 with device_id=cpu) with
SGD+momentum. Each implementation runs in its own fresh pair of rank processes, so peak
RSS (ru_maxrss, max over ranks) is not polluted by the other. The implementations
alternate for ``--rounds`` rounds (a shared machine's load drifts); the reported step time
is the median over rounds of each round's median step. Targets: time ratio <= 1.0,
memory ratio <= 1.05 (impl / FSDP1).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD_SIZE = 2
D_MODEL, N_HEAD, D_FF, LAYERS, VOCAB = 512, 8, 2048, 6, 1000
SEQ, BATCH = 64, 8


class Transformer(nn.Module):
    """Embedding + 6 encoder layers + tied output projection (~19.5M parameters)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(D_MODEL, N_HEAD, D_FF, dropout=0.0) for _ in range(LAYERS)
        )
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (S, B, D)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)  # (S, B, V)


def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return recurse or isinstance(module, nn.TransformerEncoderLayer)


def wrap(name: str, model: nn.Module) -> nn.Module:
    if name == "torch-fsdp2":  # bench_impl_vs_fsdp2.py: each encoder layer, then the root
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        return fully_shard(model)
    if name == "impl":
        from fsdp_conformance.impl import (
            BackwardPrefetch,
            FullyShardedDataParallel,
            ShardingStrategy,
        )
    else:
        from torch.distributed.fsdp import (
            BackwardPrefetch,
            FullyShardedDataParallel,
            ShardingStrategy,
        )
    return FullyShardedDataParallel(
        model,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        auto_wrap_policy=policy,
        limit_all_gathers=True,
        device_id=torch.device("cpu"),
    )


def rank_main(rank: int, name: str, store_path: str, steps: int, results: dict) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    model = wrap(name, Transformer())
    optim = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    generator = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (SEQ + 1, BATCH), generator=generator)
        dist.barrier()
        start = time.perf_counter()
        optim.zero_grad()
        logits = model(tokens[:-1])
        loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), tokens[1:].reshape(-1))
        loss.backward()
        optim.step()
        times.append(time.perf_counter() - start)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results[(name, rank)] = (statistics.median(times), peak_rss_mib, loss.item())
    dist.barrier()
    dist.destroy_process_group()


def measure(name: str, steps: int) -> tuple[float, float, float]:
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        results = manager.dict()
        mp.spawn(rank_main, (name, os.path.join(tmp, "store"), steps, results), nprocs=WORLD_SIZE)
        rows = [results[(name, r)] for r in range(WORLD_SIZE)]
    return max(r[0] for r in rows), max(r[1] for r in rows), rows[0][2]


def compare(reference: str, description: str, targets: str = "") -> None:
    """Parse ``--steps`` / ``--rounds``, measure ``impl`` and ``reference`` in alternating
    rounds, print each round, the medians and the ratios impl / reference.

    Args:
        reference: the adapter name compared with ``impl`` (a name ``wrap`` knows).
        description: the command's one-line description.
        targets: appended to the ratio line (e.g. the targets the ratios are held to).
    """
    parser = argparse.ArgumentParser(description=description)
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
    runs: dict[str, list[tuple[float, float, float]]] = {"impl": [], reference: []}
    for round_index in range(args.rounds):
        for name, rows in runs.items():
            rows.append(measure(name, args.steps))
            step, rss, loss = rows[-1]
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
    (impl_step, impl_rss), (ref_step, ref_rss) = summary["impl"], summary[reference]
    short = reference.removeprefix("torch-")
    print(
        f"ratio impl/{short}: time {impl_step / ref_step:.3f}, memory {impl_rss / ref_rss:.3f}"
        f"{targets}"
    )


def main() -> None:
    compare(
        "torch-fsdp1",
        __doc__.splitlines()[0],
        " (targets: time <= 1.0, memory <= 1.05)",
    )


if __name__ == "__main__":
    main()
