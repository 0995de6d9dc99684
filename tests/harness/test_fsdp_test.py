"""FSDPTest: unittest classes whose test methods run in every rank (under pytest and under
plain unittest), run_subtests, and the seed's helpers."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from conftest import runtime_files, write_test
from fsdp_conformance.testing import (
    DummyProcessGroup,
    FSDPInitMode,
    FSDPTest,
    device_sleep,
    get_cycles_per_ms,
    get_full_params,
)

pytest_plugins = ["pytester"]

CASES = """
import unittest

import torch
import torch.distributed as dist

from fsdp_conformance.testing import FSDPTest


class TestInRanks(FSDPTest):
    def setUp(self):
        super().setUp()
        self.value = torch.ones(1) * (self.rank + 1)

    def test_all_reduce(self):
        dist.all_reduce(self.value)
        self.assertEqual(self.value.item(), 3.0)
        self.assertEqual(self.world_size, 2)
        self.assertEqual(dist.get_world_size(self.process_group), 2)
        self.assertTrue(self.init_method.startswith(("file://", "threaded://")))

    def test_rank_one_fails(self):
        self.assertEqual(self.rank, 0, "rank one disagrees")

    def test_subtests(self):
        seen = []
        self.run_subtests({"a": [1, 2], "b": ["x", "y", "z"]}, lambda a, b: seen.append((a, b)))
        self.assertEqual(len(seen), 6)

    def test_failing_subtest(self):
        def check(size):
            self.assertNotEqual(size, 4)

        self.run_subtests({"size": [2, 4, 8]}, check)

    def test_skips(self):
        self.skipTest("skipped inside the ranks")


class TestInThreads(TestInRanks):
    fsdp_mode = "thread"


class TestWorldSizeThree(FSDPTest):
    @property
    def world_size(self):
        return 3

    def test_three(self):
        self.assertEqual(dist.get_world_size(), 3)


if __name__ == "__main__":
    unittest.main()
"""


def test_fsdp_test_methods_run_in_every_rank(pytester):
    write_test(pytester, "test_cases", CASES)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=5, failed=4, skipped=2)
    result.stdout.fnmatch_lines(
        [
            "*TestInRanks.test_failing_subtest*",
            "*AssertionError: 4 == 4*",
            "*in subtest {'size': 4}*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*TestInRanks.test_rank_one_fails*",
            "*rank 1 of 2 failed: AssertionError: 1 != 0 : rank one disagrees*",
        ]
    )
    result.stdout.fnmatch_lines(["SKIPPED*skipped inside the ranks*"])


def test_fsdp_test_under_plain_unittest(pytester, private_tmpdir):
    path = write_test(pytester, "test_cases", CASES)
    proc = subprocess.run(
        [
            sys.executable,
            str(path),
            "TestInRanks.test_all_reduce",
            "TestInRanks.test_rank_one_fails",
        ],
        cwd=pytester.path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert "Ran 2 tests" in proc.stderr
    assert "FAILED (failures=1)" in proc.stderr
    assert "rank 1 of 2 failed: AssertionError: 1 != 0 : rank one disagrees" in proc.stderr
    assert runtime_files(private_tmpdir) == []


def test_fsdp_test_is_a_testcase_with_the_seed_properties():
    assert issubclass(FSDPTest, __import__("unittest").TestCase)
    case = FSDPTest()
    assert case.world_size == 2  # CPU host
    with pytest.raises(RuntimeError, match="only while a test runs in its ranks"):
        _ = case.rank


def test_helpers():
    group = DummyProcessGroup(rank=1, size=4)
    assert (group.rank(), group.size()) == (1, 4)
    assert FSDPInitMode.CUDA_AFTER is FSDPInitMode.DEVICE_AFTER is FSDPInitMode.AFTER
    # the zoo's DeviceInit, with the seed's names as aliases
    assert {m.name for m in FSDPInitMode} == {"BEFORE", "AFTER", "NEVER"}
    start = time.perf_counter()
    device_sleep(60, "cpu")
    assert time.perf_counter() - start >= 0.06
    model = nn.Linear(3, 2)
    full = get_full_params(model)
    assert [p.shape for p in full] == [torch.Size([2, 3]), torch.Size([2])]
    assert all(torch.equal(a, b) for a, b in zip(full, model.parameters()))
    assert full[0].data_ptr() != model.weight.data_ptr()  # copies


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")
def test_get_cycles_per_ms_needs_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        get_cycles_per_ms()
