"""Reproduce fairscale 0.4.13's deviations on 2 CPU ranks: python fairscale_deviations.py"""

import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fsdp_conformance.adapters import get_adapter
from fsdp_conformance.suite.memory_bound import measure_residency


def outcome(action):
    try:
        action()
    except Exception as error:  # noqa: BLE001 -- report whatever fairscale raised
        return f"{type(error).__name__}: {str(error)[:70]!r}"
    return "no error"


class ToFloat(nn.Module):  # a float32 op between the root's input cast and an inner instance
    def forward(self, x):
        return x.float()


def run(rank, store):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    fs, x = get_adapter("fairscale"), torch.ones(2, 8)
    bf16 = {"param_dtype": torch.bfloat16}
    fp16 = {"param_dtype": torch.float16}
    lin = nn.Linear(8, 8)
    fs.wrap(lin)
    summoned = fs.wrap(nn.Sequential(fs.wrap(nn.Linear(8, 8)), nn.Linear(8, 8)))
    summoned(x).sum().backward()

    def forward_inside_summon():
        with fs.summon_full_params(summoned):
            summoned(x)

    a, b = fs.wrap(nn.Linear(8, 8)), fs.wrap(nn.Linear(8, 8))
    first, second = (b, a) if rank == 1 else (a, b)  # rank 1 runs them in the other order
    reports = {
        "parity.bf16 (root)": outcome(lambda: fs.wrap(nn.Linear(8, 8), mixed_precision=bf16)(x)),
        "parity.bf16 (inner instance)": outcome(
            lambda: fs.wrap(
                nn.Sequential(ToFloat(), fs.wrap(nn.Linear(8, 8), mixed_precision=fp16)),
                mixed_precision=fp16,
            )(x)
        ),
        "misuse.wrap_twice": outcome(lambda: fs.wrap(lin)),
        "misuse.forward_inside_summon": outcome(forward_inside_summon),
        "exec_order.divergent": outcome(lambda: second(first(x)).sum().backward()),
    }
    # peak resident non-root unsharded buffers per iteration, 6 wrapped Linears, a device that
    # never catches up by itself; the bound is 2 per phase
    limited = measure_residency(fs, dist.group.WORLD, {"limit_all_gathers": True}, "strict")
    peaks = limited.peak_table().split("\n")
    reports["memory_bound"] = ", ".join(line for line in peaks if "step" not in line)
    if rank == 0:
        for check, result in reports.items():
            print(f"{check:32} {result}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(tempfile.mktemp(),), nprocs=2)
