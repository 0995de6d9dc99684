"""fsdp_conformance.collective_observer: every collective at torch's dispatcher, to listeners.

In two real ranks (gloo, the harness's default mode): torch.distributed's collectives and the
functional collectives DTensor issues are both seen, with their dtypes and groups, in inference
mode too; a functional collective's autograd is torch's; nested collectives are reported once;
``done`` runs when the collective has ended; a removed listener hears nothing more. Thread
mode (the threaded process group's methods) is covered by tests/harness/test_collective_records.py.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch

from fsdp_conformance import collective_observer
from fsdp_conformance.constants import Op


class Recorder:
    """A listener keeping (op, torch's name, group, dtypes) and, per call, whether it ended."""

    def __init__(self) -> None:
        self.calls: list[collective_observer.CollectiveCall] = []
        self.ended: list[threading.Event] = []
        self.thread = threading.get_ident()

    def __call__(self, call: collective_observer.CollectiveCall):
        if threading.get_ident() != self.thread:
            return None
        self.calls.append(call)
        ended = threading.Event()
        self.ended.append(ended)
        return lambda error: ended.set()


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    recorder = Recorder()
    remove = collective_observer.add_listener(recorder)
    try:
        yield recorder
    finally:
        remove()


@pytest.mark.world_size(2)
def test_both_kinds_are_seen_with_their_dtypes_and_groups(dist) -> None:
    import torch.distributed as tdist
    import torch.distributed._functional_collectives as funcol

    world = dist.group
    sub = tdist.new_group([0, 1])
    with recording() as recorder:
        _issue_each_kind(tdist, funcol, world, sub)
    seen = [(c.op, c.name, c.group is world, c.dtypes) for c in recorder.calls]
    f32, f64 = torch.float32, torch.float64
    assert seen == [
        (Op.ALL_REDUCE, "c10d.allreduce_", True, (torch.bfloat16,)),
        (Op.ALL_GATHER, "c10d._allgather_base_", False, (f32, f32)),
        (Op.REDUCE_SCATTER, "c10d._reduce_scatter_base_", True, (f64, f64)),
        ("broadcast", "c10d.broadcast_", True, (f32,)),
        ("barrier", "c10d.barrier", True, (torch.uint8,)),
        (Op.REDUCE_SCATTER, "_c10d_functional.reduce_scatter_tensor", True, (torch.float16,)),
        (Op.ALL_REDUCE, "c10d.allreduce_", True, (f32,)),  # inference mode: seen
    ]
    # each ended (its Work completed; the functional one: the c10d op it ran)
    assert all(ended.wait(timeout=30) for ended in recorder.ended)


@pytest.mark.world_size(2)
def test_functional_collectives_keep_torch_autograd(dist) -> None:
    """DTensor's gather of a parameter differentiates into a reduce-scatter, as without us."""
    import torch.distributed._functional_collectives as funcol

    shard = torch.full((2,), float(dist.rank + 1), requires_grad=True)
    with recording() as recorder:
        full = funcol.all_gather_tensor_autograd(shard, 0, dist.group)
        assert full.grad_fn is not None
        (full * torch.arange(4.0)).sum().backward()
    # d/d shard of sum_r (full * arange): each rank's piece, summed over both ranks
    expected = torch.arange(4.0).view(2, 2)[dist.rank] * dist.world_size
    torch.testing.assert_close(shard.grad, expected)
    names = [call.name for call in recorder.calls]
    assert names == [
        "_c10d_functional.all_gather_into_tensor",  # the c10d op inside it is not reported again
        "_c10d_functional.reduce_scatter_tensor",  # its backward
    ], names


def _issue_each_kind(tdist, funcol, world, sub) -> None:
    tdist.all_reduce(torch.ones(2, dtype=torch.bfloat16))
    tdist.all_gather_into_tensor(torch.empty(4), torch.ones(2), group=sub)
    tdist.reduce_scatter_tensor(torch.empty(1, dtype=torch.float64), torch.ones(2).double())
    tdist.broadcast(torch.ones(1), 0)
    tdist.barrier()
    funcol.reduce_scatter_tensor(torch.ones(4, dtype=torch.float16), "sum", 0, world).wait()
    with torch.inference_mode():
        tdist.all_reduce(torch.ones(1))


def test_install_is_idempotent_and_a_removed_listener_hears_nothing() -> None:
    collective_observer.install()
    libraries = list(collective_observer._libraries)
    collective_observer.install()
    assert collective_observer._libraries == libraries
    assert len(libraries) == len(collective_observer.NAMESPACES)
    heard = []
    remove = collective_observer.add_listener(heard.append)
    remove()
    assert heard.append not in collective_observer._listeners


@pytest.mark.parametrize(
    ("name", "op"),
    [
        ("allreduce_coalesced_", Op.ALL_REDUCE),
        ("_allgather_base_", Op.ALL_GATHER),
        ("reduce_scatter_tensor_coalesced", Op.REDUCE_SCATTER),
        ("reduce_", "reduce"),
        ("monitored_barrier_", "barrier"),
        ("alltoall_base_", "all_to_all"),
        ("send", None),
        ("wait_tensor", None),
    ],
)
def test_names_of_torch_ops_and_methods(name: str, op: str | None) -> None:
    assert collective_observer.collective_of(name) == op
