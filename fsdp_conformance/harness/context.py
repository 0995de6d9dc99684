"""The ``dist`` object a test body receives in every rank (attributes: docs/harness.md)."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any


@dataclasses.dataclass
class RankContext:
    """One rank's view of the test world (the value of the ``dist`` fixture inside a rank)."""

    rank: int
    world_size: int
    # the default process group (``torch.distributed.group.WORLD``)
    group: Any
    # cpu, or cuda:<its GPU> (its own under nccl, one it shares with other ranks under gloo)
    device: Any
    # "gloo", "nccl" or "threaded" (thread mode)
    backend: str
    # shared by all ranks of this test; removed after the test
    tmp_path: pathlib.Path
    # --fsdp-impl
    impl: str = "impl"
    mode: str = "process"
    # the GPU of each rank (one per rank under nccl; repeated where ranks share one), () on CPU
    gpu_ids: tuple[int, ...] = ()
    # pytest node id
    test_id: str = ""
    # rendezvous URL ("file://<FileStore path>"; "threaded://" in thread mode)
    init_method: str = ""

    @classmethod
    def of_task(cls, task: Any, **fields: Any) -> RankContext:
        """The context of one rank running ``task`` (a ``wire.RankTask``: its ``tmp_path``,
        ``impl`` and ``test_id``); ``fields``: the others."""
        tmp_path = pathlib.Path(task.tmp_path)
        return cls(tmp_path=tmp_path, impl=task.impl, test_id=task.test_id, **fields)

    @property
    def placement(self) -> str:
        """Where the ranks run, for the report: ``cpu (gloo)``, ``cuda:0 shared by 2 ranks
        (gloo)``, ``cuda, one GPU per rank (nccl)``."""
        if self.device.type == "cpu":
            return f"cpu ({self.backend})"
        if len(set(self.gpu_ids)) < len(self.gpu_ids):
            shared = ", ".join(f"cuda:{index}" for index in sorted(set(self.gpu_ids)))
            return f"{shared} shared by {self.world_size} ranks ({self.backend})"
        return f"{self.device.type}, one GPU per rank ({self.backend})"

    def barrier(self) -> None:
        """Block until every rank reached this barrier (on the default group)."""
        import torch.distributed as torch_dist

        device_ids = [self.device.index] if self.backend == "nccl" else None
        torch_dist.barrier(group=self.group, device_ids=device_ids)


class DistPlaceholder:
    """The ``dist`` fixture's value in the pytest process: fixtures that depend on ``dist`` can
    read the world's shape, nothing that exists only in a rank."""

    def __init__(self, world_size: int, mode: str, impl: str) -> None:
        self.world_size = world_size
        self.mode = mode
        self.impl = impl

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"dist.{name} is only available inside the test body, which runs in every rank; "
            "in a fixture, return fsdp_conformance.harness.InRank(factory, ...) to build a value "
            "inside each rank"
        )

    def __repr__(self) -> str:
        return f"<dist placeholder world_size={self.world_size} mode={self.mode}>"
