"""Concurrency: pytest-xdist workers each run their own rank sets without rendezvous
collisions; GPU tests take GPUs from a cross-worker pool (exercised with a fake GPU count)."""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

from conftest import write_test
from fsdp_conformance import constants
from fsdp_conformance.harness import gpus

pytest_plugins = ["pytester"]

EIGHT = """
import os

import pytest
import torch
import torch.distributed as tdist


@pytest.mark.parametrize("index", range(8))
def test_collectives(dist, index):
    t = torch.full((4,), float(dist.rank + index))
    tdist.all_reduce(t)
    assert t.tolist() == [float(2 * index + 1)] * 4
    dist.barrier()
"""


def test_xdist_runs_eight_two_rank_tests_concurrently(pytester):
    write_test(pytester, "test_eight", EIGHT)
    result = pytester.runpytest("-p", "no:cacheprovider", "-n", "2")
    result.assert_outcomes(passed=8)


GPU_TESTS = """
import json
import os
import os
import time

import pytest


@pytest.mark.gpus(2)
@pytest.mark.parametrize("index", range(4))
def test_uses_both_gpus(dist, index):
    start = time.time()
    time.sleep(0.3)
    if dist.rank == 0:
        path = os.path.join(os.environ["HARNESS_OUT"], f"{index}.json")
        with open(path, "w") as out:
            json.dump({"gpus": list(dist.gpu_ids), "start": start, "end": time.time()}, out)


@pytest.mark.gpus(3)
def test_needs_more_gpus_than_present(dist):
    pass
"""


def test_gpu_pool_never_gives_a_gpu_to_two_tests(pytester, tmp_path, monkeypatch):
    out = tmp_path / "intervals"
    out.mkdir()
    monkeypatch.setenv("HARNESS_OUT", str(out))
    monkeypatch.setenv(constants.ENV_FAKE_GPUS, "2")
    monkeypatch.setenv(constants.ENV_GPU_LOCK_DIR, str(tmp_path / "locks"))
    write_test(pytester, "test_gpus", GPU_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", "-n", "2", "-rs")
    result.assert_outcomes(passed=4, skipped=1)
    result.stdout.fnmatch_lines(["*needs 3 GPUs, 2 available*"])
    intervals = sorted(
        (r["start"], r["end"], tuple(sorted(r["gpus"])))
        for r in (json.loads(p.read_text()) for p in out.iterdir())
    )
    assert len(intervals) == 4
    assert all(ids == (0, 1) for _, _, ids in intervals)
    for (_, end, _), (start, _, _) in itertools.pairwise(intervals):
        assert end <= start, f"two tests held the same GPUs at once: {intervals}"


CUDA_ON_CPU = """
import pytest


@pytest.mark.cuda
def test_needs_cuda(dist):
    raise AssertionError("must not run on a CPU-only host")


@pytest.mark.gpus(1)
def test_needs_a_gpu(dist):
    raise AssertionError("must not run on a CPU-only host")
"""


def test_cuda_tests_skip_with_a_reason_on_cpu(pytester, monkeypatch):
    monkeypatch.delenv(constants.ENV_FAKE_GPUS, raising=False)
    if gpus.gpu_count() > 0:
        pytest.skip("this host has GPUs")
    write_test(pytester, "test_cuda", CUDA_ON_CPU)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*SKIPPED ?2? *needs 1 GPU, 0 available (CPU-only host)*"])


SHARED = """
import pytest
import torch

from fsdp_conformance.harness import rank


@pytest.mark.cuda
def test_ranks_share_the_gpu(dist):
    assert (dist.backend, dist.gpu_ids) == ("gloo", (0, 0))


@pytest.mark.cuda
@pytest.mark.fsdp_mode("process-fresh")  # the guard stays on ProcessGroup in this process
def test_a_collective_gloo_cannot_carry_for_cuda_skips(dist):
    class OnCuda(torch.Tensor):
        is_cuda = True

    rank.skip_host_only_collectives()  # (installed in ranks that share a real GPU)
    dist.group.allreduce_coalesced([torch.ones(2).as_subclass(OnCuda)])
    raise AssertionError("gloo's coalesced all-reduce refuses CUDA tensors: must have skipped")
"""


def test_ranks_of_a_cuda_test_share_one_gpu_over_gloo(pytester, tmp_path, monkeypatch):
    # one (fake) GPU, two ranks: the test runs, its ranks on GPU 0 over gloo; a collective gloo
    # cannot carry for CUDA tensors skips, naming it
    monkeypatch.setenv(constants.ENV_FAKE_GPUS, "1")
    monkeypatch.setenv(constants.ENV_GPU_LOCK_DIR, str(tmp_path / "locks"))
    write_test(pytester, "test_shared", SHARED)
    junit = tmp_path / "junit.xml"
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs", f"--junitxml={junit}")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(
        ["*gloo does not carry CUDA tensors in ProcessGroup.allreduce_coalesced*own GPU (nccl)*"]
    )
    assert '<property name="fsdp_device" value="cpu (gloo)" />' in junit.read_text()


def test_the_report_names_the_device_and_backend_of_the_ranks():
    from fsdp_conformance.harness.context import RankContext

    def placement(device, backend, gpu_ids):
        return RankContext(
            0, 2, None, torch.device(device), backend, None, gpu_ids=gpu_ids
        ).placement

    assert placement("cuda:0", "gloo", (0, 0)) == "cuda:0 shared by 2 ranks (gloo)"
    assert placement("cuda:0", "nccl", (0, 1)) == "cuda, one GPU per rank (nccl)"
    assert placement("cpu", "gloo", ()) == "cpu (gloo)"


def test_acquire_is_all_or_none_and_times_out(tmp_path, monkeypatch):
    monkeypatch.setenv(constants.ENV_GPU_LOCK_DIR, str(tmp_path / "locks"))
    first = gpus.acquire_gpus(1, total=2, timeout=1, prefer=(1,))
    assert first.ids == (1,)
    with pytest.raises(TimeoutError, match="could not get 2 of 2 GPUs within 0.2 s"):
        gpus.acquire_gpus(2, total=2, timeout=0.2)
    # the failed attempt holds nothing: GPU 0 is still free
    second = gpus.acquire_gpus(1, total=2, timeout=0.2)
    assert second.ids == (0,)
    first.release()
    second.release()
    both = gpus.acquire_gpus(2, total=2, timeout=0.2)
    assert sorted(both.ids) == [0, 1]
    assert sorted(os.listdir(tmp_path / "locks")) == ["gpu0.lock", "gpu1.lock"]
    both.release()
    assert not (tmp_path / "locks").exists()  # the pool leaves nothing in the temp directory


def test_a_lock_file_unlinked_by_its_releasing_holder_is_not_taken(tmp_path, monkeypatch):
    # a waiter that opened gpu0.lock before its holder unlinked it must not count that stale
    # file as a lock: another worker may already lock the new file at the same path
    monkeypatch.setenv(constants.ENV_GPU_LOCK_DIR, str(tmp_path))
    holder = gpus.acquire_gpus(1, total=1, timeout=1)
    with open(tmp_path / "gpu0.lock") as stale:
        holder.release()
        monkeypatch.setattr(
            gpus, "open", lambda path, mode: os.fdopen(os.dup(stale.fileno())), raising=False
        )
        with pytest.raises(TimeoutError, match="could not get 1 of 1 GPUs"):
            gpus.acquire_gpus(1, total=1, timeout=0.1)


def test_a_test_that_needs_no_gpu_runs_on_cpu_while_the_gpus_are_held(monkeypatch, rank_probe):
    # one "real" GPU, held by another worker: a 1-rank test that does not need it runs on
    # CPU at once instead of waiting for it (and failing at the timeout), its ranks seeing
    # no GPU (CUDA_VISIBLE_DEVICES="")
    monkeypatch.delenv(constants.ENV_FAKE_GPUS, raising=False)
    monkeypatch.setenv(constants.ENV_GPU_LOCK_DIR, os.path.join(os.getcwd(), "locks"))
    monkeypatch.setattr(gpus, "gpu_count", lambda: 1)
    held = gpus.acquire_gpus(1, total=1, timeout=1)
    try:
        seen = rank_probe("held", backend=None)
    finally:
        held.release()
    assert (seen["device"], seen["backend"]) == ("cpu", "gloo")
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.world_size(2)
@pytest.mark.fsdp_mode("thread")
def test_a_rank_on_cpu_has_no_accelerator_even_where_torch_sees_one(dist, monkeypatch):
    # thread-mode ranks share the pytest process (and its GPUs, on a GPU host): code that asks
    # accelerator_available() (torch FSDP1's adapter, impl) follows the rank's device
    import torch

    from fsdp_conformance import device_handle

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if hasattr(torch, "accelerator"):
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert dist.device.type == "cpu" and not device_handle.accelerator_available()
    device_handle.set_rank_device(None)  # outside a rank: what torch says
    try:
        assert device_handle.accelerator_available()
    finally:
        device_handle.set_rank_device(dist.device)
