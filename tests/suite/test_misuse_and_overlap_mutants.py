"""The overlap, exec-order and bad-input checks fail on broken variants of the reference FSDP.

Each test breaks `fsdp_conformance.impl` inside the rank body (a fixture's monkeypatch would not
reach the rank processes), calls the suite's check on it and asserts the failure message.
"""

from __future__ import annotations

import time
from unittest import mock

import pytest

from fsdp_conformance.adapters import get_adapter
from fsdp_conformance.impl import comm, fully_sharded, runtime
from fsdp_conformance.suite import BaseBadInputTests, BaseExecOrderTests, overlap

# Process mode: the patches are process-global (impl's module functions, ProcessGroup methods).
pytestmark = [pytest.mark.fsdp_mode("process"), pytest.mark.world_size(2)]


# ---------------------------------------------------------------------------- overlap
def overlap_failure(dist) -> str:
    with pytest.raises(AssertionError, match="no overlap of communication") as failure:
        overlap.check_overlap(get_adapter("impl"), dist, "adapter 'impl' (broken)", retries=0)
    return str(failure.value)


def test_overlap_check_catches_a_synchronous_collective(dist):
    # an async_op=True all-gather that completes before it returns: nothing can overlap
    original = comm._all_gather_tensor

    def all_gather_waiting_at_issue(output, shard, group, async_op):
        work = original(output, shard, group=group, async_op=async_op)
        work.wait()
        return work

    with mock.patch.object(comm, "_all_gather_tensor", all_gather_waiting_at_issue):
        message = overlap_failure(dist)
    assert "(failed 1 measurements)" in message, message
    assert "4 all-gathers x 30 ms" in message and "expected <= 0.8x" in message, message


def test_overlap_check_catches_prefetch_disabled(dist):
    with mock.patch.object(runtime, "prefetch", lambda instance, direction: None):
        message = overlap_failure(dist)
    assert "with prefetch the forward took" in message, message


def test_overlap_check_skips_synchronous_adapters(dist):
    with pytest.raises(pytest.skip.Exception, match="issues its all-gathers synchronously"):
        overlap.check_overlap(get_adapter("torch-fsdp1"), dist, "adapter 'torch-fsdp1'")


def test_delayed_work_waits_until_its_deadline():
    class Finished:
        def wait(self):
            return True

        def is_completed(self):
            return True

    start = time.perf_counter()
    work = overlap.DelayedWork(Finished(), start + 0.05)
    assert not work.is_completed()
    assert work.wait() is True
    assert time.perf_counter() - start >= 0.05
    assert work.is_completed()


def test_cuda_ratios_fail_without_overlap():
    times = overlap.OverlapTimes(
        nothing=0.5, all_gather=40.0, compute=40.0, both=78.0, all_gathers=4, synchronous=0
    )
    message = overlap.cuda_overlap_failure(times, "adapter 'x'")
    assert "is not > 1.1 x both (78.00 ms): no overlap" in message, message
    good = overlap.OverlapTimes(0.5, 40.0, 40.0, 45.0, 4, 0)
    assert overlap.cuda_overlap_failure(good, "adapter 'x'") is None
    no_delay = overlap.OverlapTimes(0.5, 2.0, 40.0, 41.0, 4, 0)
    assert "faster than all_gather only" in overlap.cuda_overlap_failure(no_delay, "x")


# ---------------------------------------------------------------------------- exec order
def test_exec_order_check_catches_an_implementation_without_the_check(dist):
    with (
        mock.patch.object(runtime, "check_same_instance_on_all_ranks", lambda instance: None),
        pytest.raises(AssertionError, match="no exception was raised") as failure,
    ):
        BaseExecOrderTests().test_divergent_exec_order_raises(get_adapter("impl"), dist)
    assert f"adapter 'impl', rank {dist.rank} running" in str(failure.value)


def test_exec_order_check_catches_an_error_not_naming_the_instance(dist):
    def vague_check(instance):
        raise RuntimeError("something went wrong")

    with (
        mock.patch.object(runtime, "check_same_instance_on_all_ranks", vague_check),
        pytest.raises(AssertionError, match="does not name the problem") as failure,
    ):
        BaseExecOrderTests().test_divergent_exec_order_raises(get_adapter("impl"), dist)
    assert "got RuntimeError: something went wrong" in str(failure.value)


# ---------------------------------------------------------------------------- bad inputs
def test_bad_input_checks_catch_missing_validation(dist):
    checks = BaseBadInputTests()
    adapter = get_adapter("impl")
    with (
        mock.patch.object(fully_sharded, "_check_arguments", lambda *args: None),
        pytest.raises(AssertionError, match="no exception was raised"),
    ):
        checks.test_wrapping_a_module_twice(adapter, dist)


def test_bad_input_check_catches_a_vague_error(dist):
    def vague_compute_device(*args):
        raise RuntimeError("invalid module")

    with (
        mock.patch.object(fully_sharded, "_compute_device", vague_compute_device),
        pytest.raises(AssertionError, match="does not name the problem") as failure,
    ):
        BaseBadInputTests().test_parameters_on_mixed_devices(get_adapter("impl"), dist)
    assert "parameters on cpu and meta" in str(failure.value)


def test_bad_input_check_catches_a_slow_error(dist):
    original = fully_sharded._compute_device

    def slow_compute_device(*args):
        time.sleep(0.2)
        return original(*args)

    with (
        mock.patch.object(fully_sharded, "_compute_device", slow_compute_device),
        mock.patch("fsdp_conformance.suite.test_exec_order.DEADLINE_S", 0.1),
        pytest.raises(AssertionError, match="raised only after") as failure,
    ):
        BaseBadInputTests().test_parameters_on_mixed_devices(get_adapter("impl"), dist)
    assert "(expected within 0.1 s)" in str(failure.value)
