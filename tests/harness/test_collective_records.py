"""The collective records behind "mismatched collectives" and "never entered by the others"
(harness/collectives.py), without ranks."""

from __future__ import annotations

from fsdp_conformance.harness import collectives
from fsdp_conformance.harness.collectives import CollectiveRecord, CollectiveSlot


def test_slot_records_the_last_collective_and_how_it_ended(tmp_path) -> None:
    path = str(tmp_path / "slot")
    collectives.create_slot_file(path)
    slot = CollectiveSlot.mapped(path)
    ended = slot.enter("all_gather")
    assert collectives.read_slot_file(path) == CollectiveRecord(1, collectives.INSIDE, "all_gather")
    ended(None)
    assert slot.read().describe() == "last left all_gather (collective #1)"
    first = slot.enter("all_reduce")
    slot.enter("barrier")
    first(None)  # the end of an earlier collective does not overwrite the later one
    assert slot.read() == CollectiveRecord(3, collectives.INSIDE, "barrier")
    slot.enter("all_reduce")(RuntimeError("peer closed"))
    record = collectives.read_slot_file(path)
    assert record == CollectiveRecord(4, collectives.RAISED, "all_reduce")
    assert record.describe() == "failed in all_reduce (collective #4)"
    slot.reset()
    assert slot.read().describe() == "entered no collective"


def test_mismatch_and_unmatched() -> None:
    inside = collectives.INSIDE
    records = {
        0: CollectiveRecord(1, inside, "all_reduce"),
        1: CollectiveRecord(1, inside, "all_gather"),
    }
    assert collectives.mismatch(records) == (
        "mismatched collectives: rank 0 entered all_reduce (collective #1), "
        "rank 1 entered all_gather (collective #1)"
    )
    same = {0: CollectiveRecord(2, inside, "barrier"), 1: CollectiveRecord(1, 0, "barrier")}
    assert collectives.mismatch(same) == ""
    assert collectives.unmatched(same, {1}, 0) == "rank 1 finished the test after 1 collective(s)"
    assert collectives.unmatched(same, set(), 0) == ""  # rank 1 is still running


def test_only_default_group_collectives_are_recorded_in_thread_mode() -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from fsdp_conformance import collective_observer
    from fsdp_conformance.harness import threads
    from fsdp_conformance.harness.wire import RankTask, TestTarget

    slots = {}

    def body(dist_ctx):
        slot = collectives._current_slot()
        slots[dist_ctx.rank] = slot
        sub = dist.new_group([0, 1])
        dist.all_reduce(torch.ones(1), group=sub)  # a subgroup: not recorded
        dist.all_reduce(torch.ones(1))
        funcol.all_reduce(torch.ones(1), "sum", dist.group.WORLD).wait()  # a DTensor's kind
        dist.barrier(group=dist.group.WORLD)

    task = RankTask(TestTarget(__name__, None, (), "body"), "t", ".", "impl", timeout=60)
    outcomes, mismatch = threads.run_threaded(task, 2, lambda dist: body(dist), {})
    assert {o.status for o in outcomes.values()} == {"passed"}, outcomes
    assert mismatch == ""
    assert [slots[r].read() for r in (0, 1)] == [CollectiveRecord(3, 0, "barrier")] * 2
    # the harness's listener is removed after the test
    assert collectives._record not in collective_observer._listeners
