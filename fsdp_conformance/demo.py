"""Train a small nested model with the reference FSDP on 2 CPU ranks and compare with DDP.

Run: ``python -m fsdp_conformance.demo`` (a few seconds; gloo, FileStore in a temp dir).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

WORLD_SIZE = 2
STEPS = 5


def _model(wrap):
    """Linear layers; the middle block is an inner instance nested in an outer one."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        wrap(nn.Sequential(wrap(nn.Linear(16, 32)), nn.ReLU(), nn.Linear(32, 16))),
        wrap(nn.Linear(16, 16)),
        nn.Linear(16, 4),
    )


def _train(model, rank: int) -> list[float]:
    import torch

    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        optim.zero_grad()
        loss = model(torch.randn(32, 8, generator=generator)).pow(2).mean()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def _rank_main(rank: int, store_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from fsdp_conformance.impl import FullyShardedDataParallel as FSDP

    store = dist.FileStore(store_path, WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    ddp_model = nn.parallel.DistributedDataParallel(_model(lambda m: m))
    ddp_losses = _train(ddp_model, rank)
    fsdp_model = FSDP(_model(FSDP))
    fsdp_losses = _train(fsdp_model, rank)
    full = fsdp_model.state_dict()
    same_params = all(torch.equal(full[k], v) for k, v in ddp_model.module.state_dict().items())
    match = fsdp_losses == ddp_losses and same_params
    if rank == 0:
        instances = len(FSDP.fsdp_modules(fsdp_model))
        print(f"reference FSDP, {WORLD_SIZE} CPU ranks, {instances} instances (root + nested)")
        for step, (a, b) in enumerate(zip(fsdp_losses, ddp_losses)):
            print(f"step {step}: loss fsdp {a:.6f}  ddp {b:.6f}")
        print(f"losses and parameters {'match' if match else 'DIFFER'} DDP (bit-exact fp32)")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and not match:
        os._exit(1)


def main() -> int:
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="fsdp-demo-")
    # the ranks' optimizer imports torch._dynamo, which makes inductor's cache folder at import
    # (default: TMPDIR/torchinductor_<user>); the ranks inherit this, so it goes with `tmp`
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tmp, "inductor"))
    try:
        mp.spawn(_rank_main, args=(os.path.join(tmp, "store"),), nprocs=WORLD_SIZE)
    except Exception as error:  # noqa: BLE001  a rank failed: its traceback is already printed
        print(f"demo failed: {error}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
